"""Fuzzing the router's gRPC RPCs (Abort, GetServerInfo, RegisterWorker, Heartbeat, health, reflection):
random, mutated-valid and wire-level messages, with and without the cluster secret. The whole
fuzz suite (fuzz_support.py): every call gets OK or a clear refusal with details, never UNKNOWN,
INTERNAL, a 500 or a hang; each test ends with every service SERVING, every KV block free, the
oracle's tokens through the router and no traceback logged."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest
from fuzz_messages import TEXT, mix
from fuzz_support import (
    HEALTH_CHECK,
    MODEL,
    PREFILL_SERVICE,
    PROBE_TIMEOUT_S,
    ROUTER_SERVICE,
    C,
    Front,
    Outcome,
    _call,
    _check,
    _decodable,
    _end,
    fuzz_settings,
)
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from helpers_procs import free_port
from hypothesis import given
from hypothesis import strategies as st
from router_helpers import MAX_MODEL_LEN, worker_load
from test_bad_input import VOCAB

from splitserve.protos import generate_pb2, router_pb2

# ---- 1. the router's public RPCs -----------------------------------------------------------------
HOSTS = ["127.0.0.1", "localhost", "[::1]", "0.0.0.0", "127.0.0.2", "10.255.255.1", "[::]"]


@st.composite
def worker_address(draw, ports: list[int]) -> str:
    """An address a worker might register: the real workers' ports (and the router's own, its
    HTTP and metrics ports, the prefill's KV listener) under several host names, a closed port,
    or odd text."""
    kind = draw(st.sampled_from(["known"] * 4 + ["odd_host", "odd_port", "text"]))
    if kind == "text":
        return draw(TEXT)
    host = draw(st.sampled_from(HOSTS))
    port = str(draw(st.sampled_from(ports)))
    if kind == "odd_host":
        host = draw(
            st.text(st.sampled_from("abcxyz-._é日0123456789"), min_size=1, max_size=20)
            | st.just("a" * 300)
            | st.sampled_from(["[:::]", "[1.2.3.4]", "[fe80::1%eth0]", "-", "..", "_"])
        )
    elif kind == "odd_port":
        port = draw(
            st.sampled_from(["0", "65535", "65536", "99999", "00080", "٣٣", "", "-1", "1e3"])
            | st.integers(0, 10**6).map(str)
        )
    return f"{host}:{port}"


def _router_ports(front: Front, cluster) -> list[int]:
    kv = asyncio.run(worker_load(cluster.prefill, "prefill")).kv_address.port
    own = [int(a.rsplit(":", 1)[1]) for a in (cluster.prefill, cluster.decode, front.address)]
    return [*own, front.http_port, front.metrics, kv, free_port()]


def _auth(front: Front):
    """Mostly the cluster secret; else none, a wrong one, or odd header values."""
    return st.sampled_from(["secret"] * 4 + ["none", "wrong", "odd"]).flatmap(
        lambda kind: {
            "secret": st.just(front.bearer),
            "none": st.none(),
            "wrong": st.just((("authorization", f"Bearer {secrets.token_urlsafe(24)}"),)),
            "odd": st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60).map(
                lambda v: (("authorization", v),)
            ),
        }[kind]
    )


def _control_valid(front: Front, cluster, rpc: str) -> st.SearchStrategy[Message]:
    cls = (
        router_pb2.RegisterWorkerRequest if rpc == "RegisterWorker" else router_pb2.HeartbeatRequest
    )
    valid = st.builds(
        lambda role, address: cls(role=role, address=address),
        st.sampled_from([generate_pb2.WORKER_ROLE_PREFILL, generate_pb2.WORKER_ROLE_DECODE]),
        worker_address(_router_ports(front, cluster)),
    )
    return valid


ROUTER_RPCS = {  # name: (method, request class, examples)
    "Abort": ("/splitserve.v1.GenerateService/Abort", generate_pb2.AbortRequest, 100),
    "GetServerInfo": (
        "/splitserve.v1.GenerateService/GetServerInfo",
        generate_pb2.GetServerInfoRequest,
        50,
    ),
    "RegisterWorker": (
        "/splitserve.v1.RouterControl/RegisterWorker",
        router_pb2.RegisterWorkerRequest,
        100,
    ),
    "Heartbeat": ("/splitserve.v1.RouterControl/Heartbeat", router_pb2.HeartbeatRequest, 100),
    "health": (HEALTH_CHECK, health_pb2.HealthCheckRequest, 100),
}
REPLY = {
    "Abort": generate_pb2.AbortResponse,
    "GetServerInfo": generate_pb2.ServerInfo,
    "RegisterWorker": router_pb2.RegisterWorkerResponse,
    "Heartbeat": router_pb2.HeartbeatResponse,
    "health": health_pb2.HealthCheckResponse,
}
SERVICE_NAMES = [
    "",
    ROUTER_SERVICE,
    "splitserve.v1.RouterControl",
    PREFILL_SERVICE,
    "grpc.health.v1.Health",
    "splitserve.v1.GenerateService ",
]


@pytest.mark.parametrize("rpc", list(ROUTER_RPCS))
def test_router_rpcs_take_random_and_mutated_messages(front, cluster, oracle, logs, rpc):
    method, cls, n = ROUTER_RPCS[rpc]
    if rpc in ("RegisterWorker", "Heartbeat"):
        valid = _control_valid(front, cluster, rpc)
        auth = _auth(front)
    else:
        valid = {
            "Abort": TEXT.map(lambda r: generate_pb2.AbortRequest(request_id=r)),
            "GetServerInfo": st.just(generate_pb2.GetServerInfoRequest()),
            "health": st.sampled_from(SERVICE_NAMES).map(
                lambda s: health_pb2.HealthCheckRequest(service=s)
            ),
        }[rpc]
        auth = st.none() | st.just((("authorization", "Bearer " + "k" * 40),))
    messages = mix(cls, valid)
    # RegisterWorker dials a new address: health Check, then (prefill) GetLoad and a TCP connect
    # to the KV listener, each within the probe timeout; nothing may wait longer than that
    bound = 3 * PROBE_TIMEOUT_S + 3.0
    with grpc.insecure_channel(front.address) as channel:

        @fuzz_settings(n)
        @given(messages, auth)
        def check(msg, metadata) -> None:
            raw = msg if isinstance(msg, bytes) else msg.SerializeToString()
            out = _call(channel, method, raw, metadata=metadata, timeout=bound + 10)
            _check(out, raw, rpc)
            assert out.seconds < bound, (rpc, raw[:120], f"took {out.seconds:.1f}s")
            if not _decodable(cls, raw):
                assert out.code == C.INVALID_ARGUMENT and "protobuf" in out.details, (
                    out.code,
                    out.details,
                )
                return
            req = cls.FromString(raw)
            reply = REPLY[rpc].FromString(out.replies[0]) if out.code == C.OK else None
            secret = metadata == front.bearer
            if rpc in ("RegisterWorker", "Heartbeat") and not secret:
                assert out.code == C.PERMISSION_DENIED and "secret" in out.details, out
                assert front.secret not in out.details
            elif rpc == "Abort":
                assert out.code == C.OK and not reply.found  # nothing is in flight
            elif rpc == "GetServerInfo":
                assert out.code == C.OK
                assert (reply.model_name, reply.vocab_size, reply.max_model_len) == (
                    MODEL,
                    VOCAB,
                    MAX_MODEL_LEN,
                )
            elif rpc == "Heartbeat":
                assert out.code == C.OK
            elif rpc == "RegisterWorker":
                if req.role not in (
                    generate_pb2.WORKER_ROLE_PREFILL,
                    generate_pb2.WORKER_ROLE_DECODE,
                ):
                    assert out.code == C.INVALID_ARGUMENT and "role" in out.details, out
                else:
                    assert out.code in (C.OK, C.INVALID_ARGUMENT, C.FAILED_PRECONDITION), out
            elif rpc == "health":  # the router's services and the server as a whole, nothing else
                known = req.service in ("", ROUTER_SERVICE, "splitserve.v1.RouterControl")
                assert out.code == (C.OK if known else C.NOT_FOUND), (req.service[:80], out)

        check()
    _end(front, cluster, oracle)


def test_register_worker_bounds_each_dial(front, cluster, oracle, logs):
    """Hand-picked addresses a fuzzer reaches rarely: a listener that never answers (the
    prefill's UCX port), an HTTP server, a blackholed IP, a name that does not resolve, a
    megabyte of host name; each is refused within the probe timeouts, naming the address
    (shortened), and a real worker under another name registers."""
    kv = _router_ports(front, cluster)[-2]
    prefill_port = cluster.prefill.rsplit(":", 1)[1]
    cases = [
        (generate_pb2.WORKER_ROLE_DECODE, f"127.0.0.1:{kv}", C.FAILED_PRECONDITION),
        (generate_pb2.WORKER_ROLE_PREFILL, f"127.0.0.1:{front.http_port}", C.FAILED_PRECONDITION),
        (generate_pb2.WORKER_ROLE_DECODE, f"127.0.0.1:{front.metrics}", C.FAILED_PRECONDITION),
        (generate_pb2.WORKER_ROLE_DECODE, "10.255.255.1:50061", C.FAILED_PRECONDITION),
        (generate_pb2.WORKER_ROLE_DECODE, "no-such-host.invalid:50061", C.FAILED_PRECONDITION),
        (generate_pb2.WORKER_ROLE_DECODE, "h" * 2**20 + ":1", C.INVALID_ARGUMENT),
        (generate_pb2.WORKER_ROLE_DECODE, f"localhost:{prefill_port}", C.FAILED_PRECONDITION),
        (generate_pb2.WORKER_ROLE_PREFILL, f"localhost:{prefill_port}", C.OK),
        (generate_pb2.WORKER_ROLE_PREFILL, cluster.decode, C.FAILED_PRECONDITION),
    ]
    method = ROUTER_RPCS["RegisterWorker"][0]
    with grpc.insecure_channel(front.address) as channel:
        for role, address, want in cases:
            raw = router_pb2.RegisterWorkerRequest(role=role, address=address).SerializeToString()
            out = _call(channel, method, raw, metadata=front.bearer, timeout=30)
            _check(out, raw, "RegisterWorker")
            assert want is None or out.code == want, (address[:80], out.code, out.details[:300])
            assert out.seconds < 3 * PROBE_TIMEOUT_S + 3, (address[:80], out.seconds)
    _end(front, cluster, oracle)


REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


@pytest.mark.parametrize("where", ["router", "prefill", "decode"])
def test_reflection_streams_take_random_and_mutated_messages(front, cluster, oracle, logs, where):
    """Reflection is a request stream: a malformed message in it ends the call with
    INVALID_ARGUMENT (service/grpc_guard.py), anything decodable is answered."""
    from grpc_reflection.v1alpha import reflection_pb2

    cls = reflection_pb2.ServerReflectionRequest
    valid = st.one_of(
        st.just(cls(list_services="")),
        st.sampled_from([ROUTER_SERVICE, PREFILL_SERVICE, "grpc.health.v1.Health"]).map(
            lambda name: cls(file_containing_symbol=name)
        ),
        st.sampled_from(["splitserve/v1/generate.proto", "nope.proto"]).map(
            lambda name: cls(file_by_filename=name)
        ),
    )
    one = mix(cls, valid)
    address = {"router": front.address, "prefill": cluster.prefill, "decode": cluster.decode}[where]
    # a reply echoes its request (megabytes here): a client that cannot take it resets the
    # stream mid-write, which grpc logs with a traceback (its own, not ours)
    big = [("grpc.max_receive_message_length", 64 * 2**20)]
    with grpc.insecure_channel(address, options=big) as channel:
        call = channel.stream_stream(REFLECTION)

        @fuzz_settings(40)
        @given(st.lists(one, min_size=1, max_size=3))
        def check(msgs) -> None:
            raws = [m if isinstance(m, bytes) else m.SerializeToString() for m in msgs]
            try:
                replies = list(call(iter(raws), timeout=20))
                code, details = C.OK, ""
            except grpc.RpcError as err:
                replies, code, details = [], err.code(), err.details() or ""
            out = Outcome(code, replies, details, 0.0)
            _check(out, raws[0], "reflection")
            if all(_decodable(cls, r) for r in raws):
                assert code == C.OK and len(replies) == len(raws), out
            else:
                assert code == C.INVALID_ARGUMENT and "protobuf" in details, out

        check()
    _end(front, cluster, oracle)
