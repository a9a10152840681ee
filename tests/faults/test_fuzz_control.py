"""Fuzzing the router's private control listener (`--control-port`) and health's Watch stream
(issue 34), on a router process with a control listener and a cluster secret in front of the
fault suite's workers (fuzz_control_support.py; the metrics ports: test_fuzz_metrics_ports.py).

  * the control listener's RouterControl (RegisterWorker, Heartbeat) and health Check take
    random, mutated-valid and wire-level messages with and without the cluster secret: OK or a
    clear refusal (PERMISSION_DENIED without the secret), never UNKNOWN / INTERNAL or a hang;
    every other method there (GenerateService, workers' RPCs, unknown names) is UNIMPLEMENTED,
    and RouterControl is UNIMPLEMENTED on the public port;
  * Watch, on the public port, the control listener and both workers, takes random bytes: the
    first message (SERVING / SERVICE_UNKNOWN) or INVALID_ARGUMENT naming protobuf.
After every test: every service SERVING (the control listener's RouterControl too), every KV block
free, the oracle's tokens through the router, and no traceback in any log."""

from __future__ import annotations

import secrets

import grpc
import pytest
from fuzz_control_support import CONTROL
from fuzz_messages import mix
from fuzz_support import (
    HEALTH_CHECK,
    PROBE_TIMEOUT_S,
    C,
    Front,
    _call,
    _check,
    _decodable,
    fuzz_settings,
)
from grpc_health.v1 import health_pb2
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_router_rpcs import _router_ports, worker_address

from splitserve.protos import generate_pb2, router_pb2

WATCH = "/grpc.health.v1.Health/Watch"
ROLES = [generate_pb2.WORKER_ROLE_PREFILL, generate_pb2.WORKER_ROLE_DECODE]
H = health_pb2.HealthCheckResponse
HANG_S = 3 * PROBE_TIMEOUT_S + 10  # RegisterWorker dials at most three times; generous on CI


def _auth(front: Front):
    wrong = (("authorization", f"Bearer {secrets.token_urlsafe(24)}"),)
    odd = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)
    return st.one_of(
        st.just(front.bearer), st.just(front.bearer), st.none(), st.just(wrong),
        odd.map(lambda v: (("authorization", v),)),
    )  # fmt: skip


# ---- the control listener's RPCs ------------------------------------------------------------------
CONTROL_RPCS = {
    "RegisterWorker": (router_pb2.RegisterWorkerRequest, router_pb2.RegisterWorkerResponse),
    "Heartbeat": (router_pb2.HeartbeatRequest, router_pb2.HeartbeatResponse),
}


@pytest.mark.parametrize("rpc", [*CONTROL_RPCS, "health"])
def test_control_listener_takes_random_and_mutated_messages(ctl, cluster, ended_ctl, rpc):
    front, control = ctl
    if rpc == "health":
        cls, method = health_pb2.HealthCheckRequest, HEALTH_CHECK
        names = st.sampled_from(["", CONTROL, "splitserve.v1.GenerateService", "x"])
        valid = names.map(lambda s: cls(service=s))
    else:
        (cls, _), method = CONTROL_RPCS[rpc], f"/{CONTROL}/{rpc}"
        ports = [*_router_ports(front, cluster), int(control.rsplit(":", 1)[1])]
        valid = st.builds(
            lambda r, a: cls(role=r, address=a), st.sampled_from(ROLES), worker_address(ports)
        )
    seen = set()
    with grpc.insecure_channel(control) as channel:

        @fuzz_settings(100)
        @given(mix(cls, valid), _auth(front))
        def check(msg, metadata) -> None:
            raw = msg if isinstance(msg, bytes) else msg.SerializeToString()
            out = _call(channel, method, raw, metadata=metadata, timeout=HANG_S + 30)
            _check(out, raw, rpc)
            seen.add(out.code)
            assert out.seconds < HANG_S, (rpc, raw[:120], f"took {out.seconds:.1f}s")
            if not _decodable(cls, raw):
                assert out.code == C.INVALID_ARGUMENT and "protobuf" in out.details, out
                return
            req = cls.FromString(raw)
            if rpc == "health":  # the control listener's own service and the server, only
                known = req.service in ("", CONTROL)
                assert out.code == (C.OK if known else C.NOT_FOUND), (req.service[:80], out)
                if known:
                    assert H.FromString(out.replies[0]).status == H.SERVING
            elif metadata != front.bearer:
                assert out.code == C.PERMISSION_DENIED and "secret" in out.details, out
                assert front.secret not in out.details
            elif rpc == "Heartbeat":
                assert out.code == C.OK, out
            elif req.role not in ROLES:
                assert out.code == C.INVALID_ARGUMENT and "role" in out.details, out
            else:
                assert out.code in (C.OK, C.INVALID_ARGUMENT, C.FAILED_PRECONDITION), out

        check()
    refusal = C.NOT_FOUND if rpc == "health" else C.PERMISSION_DENIED
    assert {C.OK, C.INVALID_ARGUMENT, refusal} <= seen, seen  # each kind of answer came up


FOREIGN = [
    "/splitserve.v1.GenerateService/Generate",
    "/splitserve.v1.GenerateService/Abort",
    "/splitserve.v1.GenerateService/GetServerInfo",
    "/splitserve.v1.PrefillWorker/Prefill",
    "/splitserve.v1.RouterControl/Nope",
    "/nope/nope",
]


def test_control_listener_serves_nothing_else_and_public_port_no_control(ctl, ended_ctl):
    front, control = ctl
    places = st.sampled_from([(control, m) for m in FOREIGN] + [
        (front.address, f"/{CONTROL}/{rpc}") for rpc in CONTROL_RPCS
    ])  # fmt: skip

    @fuzz_settings(40)
    @given(places, st.binary(max_size=80), st.sampled_from([front.bearer, None]))
    def check(place, raw, metadata) -> None:
        address, method = place
        with grpc.insecure_channel(address) as channel:
            out = _call(channel, method, raw, metadata=metadata, timeout=30)
        assert out.code == C.UNIMPLEMENTED, (address, method, out)

    check()


# ---- Watch ----------------------------------------------------------------------------------------
def test_watch_takes_random_bytes(ctl, cluster, ended_ctl):
    front, control = ctl
    own = {
        front.address: "splitserve.v1.GenerateService",
        control: CONTROL,
        cluster.prefill: "splitserve.v1.PrefillWorker",
        cluster.decode: "splitserve.v1.DecodeWorker",
    }
    cls = health_pb2.HealthCheckRequest
    valid = st.sampled_from(["", *own.values(), "x"]).map(lambda s: cls(service=s))

    seen = set()

    @fuzz_settings(100)
    @given(st.sampled_from(sorted(own)), mix(cls, valid))
    def check(address, msg) -> None:
        raw = msg if isinstance(msg, bytes) else msg.SerializeToString()
        with grpc.insecure_channel(address) as channel:
            watch = channel.unary_stream(WATCH)(raw, timeout=30)
            try:
                first, code, details = H.FromString(next(watch)), C.OK, ""
            except grpc.RpcError as err:
                first, code, details = None, err.code(), err.details() or ""
            finally:
                watch.cancel()
        seen.add(code if first is None else first.status)
        if not _decodable(cls, raw):
            assert code == C.INVALID_ARGUMENT and "protobuf" in details, (address, code, details)
            return
        name = cls.FromString(raw).service
        assert code == C.OK, (address, name[:40], code, details)
        known = name in ("", own[address])
        assert first.status == (H.SERVING if known else H.SERVICE_UNKNOWN), (address, name[:40])

    check()
    assert {H.SERVING, H.SERVICE_UNKNOWN, C.INVALID_ARGUMENT} <= seen, seen
