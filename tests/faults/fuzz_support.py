"""Shared parts of the fuzz tests (test_fuzz_*.py): the router process in front of the fault
suite's workers, how a case ends, raw gRPC calls, messages built from the protos' descriptors
and the HTTP checks. See test_fuzz_router_rpcs.py for what the fuzzers cover."""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any

import grpc
from fault_helpers import (
    Ledger,
    assert_clean,
    finish_case,
)
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import DecodeError, Message
from helpers_procs import ServiceProcess, health_status
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from router_helpers import SERVING

from splitserve.protos import generate_pb2_grpc

MODEL = "tiny"  # the router's --model-name
C = grpc.StatusCode
REFUSALS = {
    C.INVALID_ARGUMENT,
    C.FAILED_PRECONDITION,
    C.PERMISSION_DENIED,
    C.UNAUTHENTICATED,
    C.NOT_FOUND,
    C.RESOURCE_EXHAUSTED,
}
ALLOWED = {C.OK} | REFUSALS
PROBE_TIMEOUT_S = 1.0  # the router's registry.probe_timeout_s (default)
ROUTER_SERVICE = "splitserve.v1.GenerateService"
PREFILL_SERVICE = "splitserve.v1.PrefillWorker"
DECODE_SERVICE = "splitserve.v1.DecodeWorker"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def fuzz_settings(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
    )


# ---- the router process and the end of every case -----------------------------------------------
@dataclass
class Front:
    """A router process in front of the shared workers: gRPC, OpenAI HTTP, metrics."""

    proc: ServiceProcess
    http_port: int
    metrics: int
    secret: str

    @property
    def address(self) -> str:
        return self.proc.address

    @property
    def bearer(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.secret}"),)


def _worker_procs(cluster) -> list[ServiceProcess]:
    return [p for p in cluster.procs.procs if p.address in (cluster.prefill, cluster.decode)]


def _end(front: Front, cluster, oracle, ledger: Ledger | None = None) -> None:
    """Every service SERVING, every block free, the oracle's tokens through the router (and,
    given a ledger, exactly one router outcome per Generate it sent)."""
    for address, service in (
        (front.address, ROUTER_SERVICE),
        (cluster.prefill, PREFILL_SERVICE),
        (cluster.decode, DECODE_SERVICE),
    ):
        assert health_status(address, service) == SERVING, (address, service)

    async def end():
        async with grpc.aio.insecure_channel(front.address) as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            if ledger is not None:
                await finish_case(
                    ledger, stub, oracle, [cluster.prefill], [cluster.decode], router=front.metrics
                )
            else:
                await assert_clean(stub, oracle, [cluster.prefill], [cluster.decode])

    asyncio.run(end())
    assert _http(front, "GET", "/health")[0] == 200


# ---- gRPC calls with raw bytes -------------------------------------------------------------------
@dataclass
class Outcome:
    code: grpc.StatusCode
    replies: list[bytes]
    details: str
    seconds: float


def _call(channel, method: str, raw: bytes, stream=False, metadata=None, timeout=30.0) -> Outcome:
    start = time.monotonic()
    try:
        if stream:
            replies = list(channel.unary_stream(method)(raw, timeout=timeout, metadata=metadata))
        else:
            replies = [channel.unary_unary(method)(raw, timeout=timeout, metadata=metadata)]
        code, details = C.OK, ""
    except grpc.RpcError as err:
        replies, code, details = [], err.code(), err.details() or ""
    return Outcome(code, replies, details, time.monotonic() - start)


def _check(out: Outcome, raw: bytes, what: str, allowed=ALLOWED) -> None:
    """A status from `allowed`; a refusal says why (health's NOT_FOUND for an unknown service
    name is the health protocol's own, without details)."""
    assert out.code in allowed, (what, out.code, out.details[:300], raw[:120])
    if out.code != C.OK and not (what == "health" and out.code == C.NOT_FOUND):
        assert out.details.strip(), (what, out.code, "a refusal must say why", raw[:120])
    assert len(out.details) < 20_000, (what, "details of", len(out.details), "characters")


def _decodable(cls: type[Message], raw: bytes) -> bool:
    try:
        cls.FromString(raw)
        return True
    except DecodeError:
        return False


# ---- messages from descriptors -------------------------------------------------------------------
def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = {lo, hi, 0, 1, hi - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1}
    return st.sampled_from(sorted(e for e in edges if lo <= e <= hi)) | st.integers(lo, hi)


HUGE_SIZES = st.sampled_from([255, 256, 257, 1023, 1024, 1025, 4096, 70_000, 2**20 + 3])
ODD_CHARS = "\x00\x01\x7f\u200b\u202e\ufeff\U0001f600é#:/[]% \t\n\\\"'"
TEXT = (
    st.text(max_size=24)
    | st.text(st.sampled_from(ODD_CHARS), min_size=1, max_size=12)
    | st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "\x00", "😀", "#"]), HUGE_SIZES)
)
BYTES = st.binary(max_size=40) | st.builds(lambda n: b"\xff" * n, HUGE_SIZES)
SCALARS = {
    FD.TYPE_INT32: _ints(-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: _ints(-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: _ints(-(2**31), 2**31 - 1),
    FD.TYPE_INT64: _ints(-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: _ints(-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: _ints(-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: _ints(0, 2**32 - 1),
    FD.TYPE_FIXED32: _ints(0, 2**32 - 1),
    FD.TYPE_UINT64: _ints(0, 2**64 - 1),
    FD.TYPE_FIXED64: _ints(0, 2**64 - 1),
    FD.TYPE_FLOAT: st.floats(width=32),
    FD.TYPE_DOUBLE: st.floats(),
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_STRING: TEXT,
    FD.TYPE_BYTES: BYTES,
}


def _enum(field) -> st.SearchStrategy[int]:
    known = [v.number for v in field.enum_type.values]
    return st.sampled_from(known) | _ints(-(2**31), 2**31 - 1)  # open enums keep unknown numbers


def _single(field, depth: int) -> st.SearchStrategy:
    if field.type == FD.TYPE_MESSAGE:
        return random_message(message_factory.GetMessageClass(field.message_type), depth - 1)
    if field.type == FD.TYPE_ENUM:
        return _enum(field)
    return SCALARS[field.type]


def _is_map(field) -> bool:
    return field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def field_value(field, depth: int = 2) -> st.SearchStrategy:
    """A random value for `field`: a scalar, a message, a list (repeated) or a dict (map)."""
    if _is_map(field):
        key, value = (field.message_type.fields_by_name[n] for n in ("key", "value"))
        return st.dictionaries(_single(key, depth), _single(value, depth), max_size=4)
    if field.is_repeated:
        return st.lists(_single(field, depth), max_size=4)
    return _single(field, depth)


def assign(msg: Message, field, value) -> None:
    msg.ClearField(field.name)
    target = getattr(msg, field.name) if field.is_repeated else None
    if _is_map(field):
        if field.message_type.fields_by_name["value"].type == FD.TYPE_MESSAGE:
            for k, v in value.items():
                target[k].CopyFrom(v)
        else:
            target.update(value)
    elif target is not None:
        target.extend(value)
    elif field.type == FD.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


@st.composite
def _random_message(draw, cls: type[Message], depth: int) -> Message:
    msg = cls()
    if depth <= 0:
        return msg
    for field in cls.DESCRIPTOR.fields:
        if draw(st.booleans()):
            assign(msg, field, draw(field_value(field, depth)))
    return msg


def random_message(cls: type[Message], depth: int = 2) -> st.SearchStrategy[Message]:
    return _random_message(cls, depth)


@st.composite
def mutated(draw, valid: st.SearchStrategy[Message], skip: tuple[str, ...] = ()) -> Message:
    """A valid message with one to three fields (nested ones too) cleared or given a random
    value; fields named in `skip` are left alone."""
    msg = type(drawn := draw(valid))()
    msg.CopyFrom(drawn)  # never the strategy's own object (st.just would hand out the same one)
    for _ in range(draw(st.integers(1, 3))):
        target = msg
        fields = [f for f in target.DESCRIPTOR.fields if f.name not in skip]
        if not fields:  # an empty message: nothing to mutate
            return msg
        field = draw(st.sampled_from(fields))
        while (
            field.type == FD.TYPE_MESSAGE
            and not field.is_repeated
            and target.HasField(field.name)
            and draw(st.booleans())
        ):  # into a set sub-message
            target = getattr(target, field.name)
            fields = [f for f in target.DESCRIPTOR.fields if f.name not in skip]
            if not fields:
                break
            field = draw(st.sampled_from(fields))
        if draw(st.integers(0, 3)) == 0:
            target.ClearField(field.name)
        else:
            assign(target, field, draw(field_value(field, depth=2)))
    return msg


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@st.composite
def wire_bytes(draw, cls: type[Message], valid: st.SearchStrategy[Message]) -> bytes:
    """Bytes on the wire: random ones, a valid message cut short or with a flipped byte, or a
    valid message with a string field whose bytes are not UTF-8 (proto3 refuses them)."""
    kind = draw(st.sampled_from(["random", "cut", "flip", "utf8"]))
    if kind == "random":
        return draw(st.binary(max_size=160))
    raw = draw(valid).SerializeToString()
    # positions are drawn independently of the length (fresh ids make it vary between replays)
    if kind == "cut" and raw:
        return raw[: draw(st.integers(0, 2**16)) % len(raw)]
    if kind == "flip" and raw:
        i = draw(st.integers(0, 2**16)) % len(raw)
        return raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1 :]
    strings = [f for f in cls.DESCRIPTOR.fields if f.type == FD.TYPE_STRING]
    if not strings:
        return raw + draw(st.binary(min_size=1, max_size=8))
    field = draw(st.sampled_from(strings))
    bad = draw(
        st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"a\x80b", b"\xf8\x88\x80\x80\x80"])
    )
    return raw + _varint(field.number << 3 | 2) + _varint(len(bad)) + bad


def mix(cls: type[Message], valid: st.SearchStrategy[Message]) -> st.SearchStrategy:
    """Valid and mutated-valid messages (a mutation is mostly a refusal), random messages, and
    bytes on the wire, so that every kind of outcome comes up."""
    return st.one_of(
        valid, valid, mutated(valid), mutated(valid), random_message(cls), wire_bytes(cls, valid)
    )


_ids = itertools.count()


def fresh_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


# ---- 3. the OpenAI HTTP front --------------------------------------------------------------------
def _http(
    front: Front, method: str, path: str, body: bytes | None = None, headers=None, timeout=60.0
) -> tuple[int, dict[str, str], bytes]:
    """One plain HTTP/1.1 call on a new connection; (status, headers, the whole body). A dropped
    connection or a body cut short raises."""
    conn = http.client.HTTPConnection("127.0.0.1", front.http_port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    except OSError:
        if method == "GET" and path == "/health":
            return 0, {}, b""
        raise
    finally:
        conn.close()


def _error_shape(status: int, body: bytes, what) -> dict[str, Any]:
    err = json.loads(body)
    assert set(err) == {"error"} and isinstance(err["error"], dict), (status, what, body[:300])
    e = err["error"]
    assert set(e) == {"message", "type", "param", "code"}, (what, e)
    assert isinstance(e["message"], str) and e["message"].strip(), (what, e)
    assert isinstance(e["type"], str) and e["type"], (what, e)
    assert e["param"] is None or isinstance(e["param"], str), (what, e)
    assert e["code"] is None or isinstance(e["code"], str), (what, e)
    return e


def _events(body: bytes, what) -> list[dict[str, Any]]:
    """The JSON events of a server-sent event stream that ends with `data: [DONE]`."""
    blocks = [b for b in body.decode().split("\n\n") if b]
    assert blocks and blocks[-1] == "data: [DONE]", (what, body[-300:])
    events = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), (what, block[:200])
        events.append(json.loads(block[len("data: ") :]))
    return events


def _check_http(
    status: int, headers: dict[str, str], body: bytes, method: str, path: str, sent: Any
) -> None:
    what = (method, path, repr(sent)[:300])
    assert status < 500, (status, what, body[:500])
    assert 200 <= status < 300 or 400 <= status < 500, (status, what)
    if method == "HEAD":
        return
    if status >= 400:
        _error_shape(status, body, what)
        return
    kind = path.split("?")[0]
    if kind in ("/v1/completions", "/v1/chat/completions"):
        if headers.get("content-type", "").startswith("text/event-stream"):
            events = _events(body, what)
            assert events and not any("error" in e for e in events), (what, events[-1:])
            finishes = [c["finish_reason"] for e in events for c in e.get("choices", [])]
            assert finishes and finishes[-1] in ("stop", "length"), (what, finishes)
        else:
            out = json.loads(body)
            [choice] = out["choices"]
            assert choice["finish_reason"] in ("stop", "length"), (what, out)
            assert out["usage"]["completion_tokens"] >= 1
            cap = (
                sent.get("max_tokens", sent.get("max_completion_tokens"))
                if isinstance(sent, dict)
                else None
            )
            if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0:
                assert out["usage"]["completion_tokens"] <= cap, (what, out["usage"])
    elif kind == "/health":
        assert json.loads(body)["status"] == "ok"
    elif kind.startswith("/v1/models"):
        out = json.loads(body)
        assert out.get("id", MODEL) == MODEL or out.get("object") == "list", out
