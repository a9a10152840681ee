"""Fuzzing the workers' RPCs (PrefillWorker Prefill/Abort/ReleaseLease/GetLoad, DecodeWorker
Decode/Abort/GetLoad, health) with random and mutated-valid messages; every lease a Prefill grants
is released (fuzz_support.py for the shared checks)."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import grpc
import pytest
from fault_helpers import (
    SLOW_PREFILL,
    SLOW_PULL,
)
from fuzz_messages import TEXT, _ints, assign, field_value, mix, mutated, random_message, wire_bytes
from fuzz_support import (
    DECODE_SERVICE,
    HEALTH_CHECK,
    PREFILL_SERVICE,
    ROUTER_SERVICE,
    C,
    Outcome,
    _call,
    _check,
    _check_http,
    _decodable,
    _end,
    _events,
    fresh_id,
    fuzz_settings,
)
from grpc_health.v1 import health_pb2
from hypothesis import assume, given
from hypothesis import strategies as st
from router_helpers import MAX_MODEL_LEN, SERVING, greedy, worker_load
from test_bad_input import VOCAB

from splitserve.protos import generate_pb2, worker_pb2

# ---- 4. the workers' RPCs ------------------------------------------------------------------------
PREFILL_RPCS = {
    "Prefill": (worker_pb2.PrefillRequest, worker_pb2.PrefillResponse),
    "Abort": (generate_pb2.AbortRequest, generate_pb2.AbortResponse),
    "ReleaseLease": (worker_pb2.ReleaseLeaseRequest, worker_pb2.ReleaseLeaseResponse),
    "GetLoad": (worker_pb2.GetLoadRequest, worker_pb2.WorkerLoad),
}
DECODE_RPCS = {
    "Decode": (worker_pb2.DecodeRequest, worker_pb2.DecodeResponse),
    "Abort": (generate_pb2.AbortRequest, generate_pb2.AbortResponse),
    "GetLoad": (worker_pb2.GetLoadRequest, worker_pb2.WorkerLoad),
}


def _prefill_request(rid: str | None = None, max_tokens: int = 3) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=rid or fresh_id("fzp"),
        prompt_token_ids=[1, 44, 45, 46, 200, 201, 202],
        sampling=greedy(max_tokens, ignore_eos=True),
    )


def _safe_id(req) -> None:
    """Fuzzed ids must not hit the shared workers' test-only fault seams."""
    assume(not req.request_id.startswith((SLOW_PREFILL, SLOW_PULL)))


def _release(channel, resp: worker_pb2.PrefillResponse, ttl_ms: int) -> None:
    """The router's part after a Prefill: release the lease nobody will pull."""
    if not resp.kv.lease_id:
        return
    raw = worker_pb2.ReleaseLeaseRequest(
        lease_id=resp.kv.lease_id, request_id=resp.request_id
    ).SerializeToString()
    out = _call(channel, "/splitserve.v1.PrefillWorker/ReleaseLease", raw, timeout=10)
    assert out.code == C.OK, out
    released = worker_pb2.ReleaseLeaseResponse.FromString(out.replies[0]).released
    assert released or 0 < ttl_ms < 5000, "a lease held past its reply was released"


@pytest.mark.parametrize("rpc", list(PREFILL_RPCS))
def test_prefill_worker_rpcs_take_random_and_mutated_messages(front, cluster, oracle, logs, rpc):
    cls, reply_cls = PREFILL_RPCS[rpc]
    method = f"/splitserve.v1.PrefillWorker/{rpc}"
    valid = {
        "Prefill": st.builds(_prefill_request, max_tokens=st.integers(1, 4)),
        "Abort": TEXT.map(lambda r: generate_pb2.AbortRequest(request_id=r)),
        "ReleaseLease": st.builds(
            lambda lease, rid: worker_pb2.ReleaseLeaseRequest(lease_id=lease, request_id=rid),
            TEXT | st.uuids().map(str),
            TEXT,
        ),
        "GetLoad": _ints(0, 2**32 - 1).map(
            lambda n: worker_pb2.GetLoadRequest(max_prefix_hashes=n)
        ),
    }[rpc]
    messages = mix(cls, valid)
    with grpc.insecure_channel(cluster.prefill) as channel:

        @fuzz_settings(100 if rpc == "Prefill" else 60)
        @given(messages)
        def check(msg) -> None:
            raw = msg if isinstance(msg, bytes) else msg.SerializeToString()
            if not _decodable(cls, raw):
                out = _call(channel, method, raw)
                assert out.code == C.INVALID_ARGUMENT and "protobuf" in out.details, out
                return
            req = cls.FromString(raw)
            if rpc == "Prefill":
                _safe_id(req)
            out = _call(channel, method, raw)
            _check(out, raw, rpc)
            if out.code != C.OK:
                return
            reply = reply_cls.FromString(out.replies[0])
            if rpc == "Prefill":
                assert reply.request_id == req.request_id
                assert 0 <= reply.first_token_id < VOCAB
                assert bool(reply.kv.lease_id) != bool(reply.finish_reason), reply
                _release(channel, reply, req.lease_ttl_ms)
            elif rpc == "GetLoad":
                assert reply.role == generate_pb2.WORKER_ROLE_PREFILL and reply.total_blocks > 0
            elif rpc == "ReleaseLease":
                assert not reply.released  # no lease of theirs exists
            elif rpc == "Abort":
                assert not reply.found

        check()
        # a real lease: ReleaseLease naming another request (a huge one too) is refused and
        # leaves it held; the right pair releases it once
        for other in ("someone-else", "x" * 2**20):
            out = _call(
                channel,
                "/splitserve.v1.PrefillWorker/Prefill",
                _prefill_request().SerializeToString(),
            )
            assert out.code == C.OK, out
            resp = worker_pb2.PrefillResponse.FromString(out.replies[0])
            raw = worker_pb2.ReleaseLeaseRequest(lease_id=resp.kv.lease_id, request_id=other)
            out = _call(
                channel, "/splitserve.v1.PrefillWorker/ReleaseLease", raw.SerializeToString()
            )
            _check(out, raw.SerializeToString(), "ReleaseLease")
            assert out.code == C.INVALID_ARGUMENT, out
            _release(channel, resp, 0)
    _end(front, cluster, oracle)


def _forged_handle(real: worker_pb2.PrefillResponse | None, kv_port: int) -> Any:
    from splitserve.protos import kv_pb2

    handle = kv_pb2.KvHandle()
    if real is not None:
        handle.CopyFrom(real.kv)
    handle.lease_id = secrets.token_hex(16)
    handle.address.host, handle.address.port = "127.0.0.1", kv_port
    return handle


@st.composite
def decode_case(
    draw,
    prefill_channel,
    kv_port: int,
    made: list,
    kinds=("colocated", "first_only", "handoff", "handoff", "forged"),
):
    """(DecodeRequest, the PrefillResponse whose lease it uses or None): colocated (no handle,
    no first token), a first token only, the handle of a real Prefill, or a forged handle.
    Every PrefillResponse goes into `made`, so that no lease outlives the test."""
    kind = draw(st.sampled_from(kinds))
    rid = fresh_id("fzd")
    prompt = draw(st.sampled_from([[1, 44, 45, 46, 200, 201, 202], [5], list(range(1, 40))]))
    req = worker_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        # a handle needs a second token to come: max_tokens 1 ends at the prefill's first
        sampling=greedy(draw(st.integers(1 if kind == "colocated" else 2, 4)), ignore_eos=True),
    )
    real = None
    if kind == "first_only":
        req.first_token_id = draw(st.sampled_from([0, 7, VOCAB - 1]))
    elif kind in ("handoff", "forged"):
        pre = worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=req.sampling
        )
        out = _call(
            prefill_channel, "/splitserve.v1.PrefillWorker/Prefill", pre.SerializeToString()
        )
        assert out.code == C.OK, out
        real = worker_pb2.PrefillResponse.FromString(out.replies[0])
        assert real.kv.lease_id, real
        made.append(real)
        req.first_token_id = real.first_token_id
        req.kv.CopyFrom(real.kv if kind == "handoff" else _forged_handle(real, kv_port))
    mutate = draw(st.sampled_from(["none", "none", "message", "handle"]))
    if mutate == "message":  # the handle's address and shard map stay: a pull elsewhere waits 5 s
        req = draw(mutated(st.just(req), skip=("address", "shards")))
    elif mutate == "handle" and req.HasField("kv"):
        field = draw(
            st.sampled_from(
                [f for f in req.kv.DESCRIPTOR.fields if f.name not in ("address", "shards")]
            )
        )
        assign(req.kv, field, draw(field_value(field)))
    return req, real


@pytest.mark.parametrize("rpc", list(DECODE_RPCS))
def test_decode_worker_rpcs_take_random_and_mutated_messages(front, cluster, oracle, logs, rpc):
    cls, reply_cls = DECODE_RPCS[rpc]
    method = f"/splitserve.v1.DecodeWorker/{rpc}"
    kv_port = asyncio.run(worker_load(cluster.prefill, "prefill")).kv_address.port
    made: list[worker_pb2.PrefillResponse] = []
    with (
        grpc.insecure_channel(cluster.decode) as channel,
        grpc.insecure_channel(cluster.prefill) as prefill,
    ):
        if rpc == "Decode":
            cases = decode_case(prefill, kv_port, made)
            valid = decode_case(prefill, kv_port, made, ("colocated", "first_only")).map(
                lambda c: c[0]
            )
            messages = st.one_of(
                cases,
                cases,
                cases,
                random_message(cls).map(lambda m: (m, None)),
                wire_bytes(cls, valid).map(lambda b: (b, None)),
            )
        else:
            valid = {
                "Abort": TEXT.map(lambda r: generate_pb2.AbortRequest(request_id=r)),
                "GetLoad": _ints(0, 2**32 - 1).map(
                    lambda n: worker_pb2.GetLoadRequest(max_prefix_hashes=n)
                ),
            }[rpc]
            messages = mix(cls, valid).map(lambda m: (m, None))

        @fuzz_settings(100 if rpc == "Decode" else 60)
        @given(messages)
        def check(case) -> None:
            msg, real = case
            raw = msg if isinstance(msg, bytes) else msg.SerializeToString()
            try:
                if not _decodable(cls, raw):
                    out = _call(channel, method, raw, stream=rpc == "Decode")
                    assert out.code == C.INVALID_ARGUMENT and "protobuf" in out.details, out
                    return
                req = cls.FromString(raw)
                if rpc == "Decode":
                    _safe_id(req)
                out = _call(channel, method, raw, stream=rpc == "Decode", timeout=60)
                _check(out, raw, rpc)
                if out.code != C.OK:
                    return
                replies = [reply_cls.FromString(r) for r in out.replies]
                if rpc == "Decode":
                    _decoded(req, replies)
                elif rpc == "GetLoad":
                    assert replies[0].role == generate_pb2.WORKER_ROLE_DECODE
                    assert replies[0].total_blocks > 0
                else:
                    assert not replies[0].found
            finally:
                if (
                    real is not None
                ):  # a lease the Decode did not take is released, as the router does
                    _release_any(prefill, real)
                    made.remove(real)

        check()
        for resp in made:  # a case drawn but never sent (hypothesis may drop one) left its lease
            _release_any(prefill, resp)
    _end(front, cluster, oracle)


def _release_any(channel, resp: worker_pb2.PrefillResponse) -> None:
    """ReleaseLease after a Decode that may or may not have pulled (and so released) the lease."""
    raw = worker_pb2.ReleaseLeaseRequest(lease_id=resp.kv.lease_id, request_id=resp.request_id)
    out = _call(
        channel, "/splitserve.v1.PrefillWorker/ReleaseLease", raw.SerializeToString(), timeout=10
    )
    assert out.code == C.OK, out


def _decoded(req: worker_pb2.DecodeRequest, replies: list[worker_pb2.DecodeResponse]) -> None:
    """A served Decode stream: at most max_tokens tokens in the vocabulary (the first token
    included when this worker sampled it), a finish reason on the last chunk only."""
    assert replies, "a served Decode sends at least one chunk"
    tokens = [t for r in replies for t in r.token_ids]
    assert all(0 <= t < VOCAB for t in tokens)
    limit = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else MAX_MODEL_LEN
    assert len(tokens) <= limit
    assert replies[-1].finish_reason in (
        generate_pb2.FINISH_REASON_STOP,
        generate_pb2.FINISH_REASON_LENGTH,
    ), replies[-1]
    assert all(r.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for r in replies[:-1])


@pytest.mark.parametrize("address", ["prefill", "decode"])
def test_worker_health_checks(front, cluster, oracle, logs, address):
    target = getattr(cluster, address)
    valid = st.sampled_from(["", PREFILL_SERVICE, DECODE_SERVICE, ROUTER_SERVICE]).map(
        lambda s: health_pb2.HealthCheckRequest(service=s)
    )
    cls = health_pb2.HealthCheckRequest
    with grpc.insecure_channel(target) as channel:

        @fuzz_settings(50)
        @given(mix(cls, valid))
        def check(msg) -> None:
            raw = msg if isinstance(msg, bytes) else msg.SerializeToString()
            out = _call(channel, HEALTH_CHECK, raw, timeout=10)
            _check(out, raw, "health")
            if not _decodable(cls, raw):
                assert out.code == C.INVALID_ARGUMENT, out
            elif out.code == C.OK:
                assert health_pb2.HealthCheckResponse.FromString(out.replies[0]).status == SERVING

        check()
    _end(front, cluster, oracle)


def test_the_helpers_can_fail():
    """The checks above are not vacuous: a 500, a bare 4xx, an UNKNOWN and a stream without
    [DONE] are each caught."""
    with pytest.raises(AssertionError):
        _check_http(500, {}, b'{"error": {}}', "POST", "/v1/completions", {})
    with pytest.raises(AssertionError):
        _check_http(400, {}, b'{"detail": "x"}', "POST", "/v1/completions", {})
    with pytest.raises(AssertionError):
        _check(Outcome(C.UNKNOWN, [], "boom", 0.0), b"", "Abort")
    with pytest.raises(AssertionError):
        _check(Outcome(C.INVALID_ARGUMENT, [], "", 0.0), b"", "Abort")
    with pytest.raises(AssertionError):
        _events(b'data: {"choices": []}\n\n', "stream")
