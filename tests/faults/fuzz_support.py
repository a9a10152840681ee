"""Shared parts of the fuzz tests (test_fuzz_*.py): the router process in front of the fault
suite's workers, how a case ends, raw gRPC calls and the HTTP checks (fuzz_messages.py builds
the messages from the protos' descriptors). See test_fuzz_router_rpcs.py for what the fuzzers
cover."""

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
from google.protobuf.message import DecodeError, Message
from helpers_procs import ServiceProcess, health_status
from hypothesis import HealthCheck, settings
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
