"""The per-caller concurrency limit end to end (`auth.max_concurrent`, router/caller_limits.py),
with real processes: a router with two API keys and `max_concurrent: 2`, in front of workers
whose decode worker holds every request whose id starts with HOLD before its KV pull (blocks
reserved) until the request is cancelled. Key A holds its two slots, one through gRPC and one
through an HTTP stream (one limit per key, whatever the transport); its third request is
refused, RESOURCE_EXHAUSTED with `retry-after-ms` over gRPC and 429 with `Retry-After` over
HTTP, with a message that says how to get in; key B is served meanwhile. A slot comes back when
its request ends (cancelled, or the client gone), exactly once: A gets both slots back, and
the third is refused again. At the end every block is free, every service SERVING, and no log
holds a traceback."""

from __future__ import annotations

import asyncio
import http.client
import json
import secrets

import grpc
import pytest
import yaml
from fault_helpers import CLEAN_PROMPT, metric, start_worker
from helpers_procs import ProcessGroup, free_port, health_status
from router_helpers import (
    MAX_MODEL_LEN,
    SERVING,
    assert_workers_free,
    greedy,
    ids_request,
    wait_until,
)

from splitserve.protos import generate_pb2_grpc

HOLD = "hold"  # the decode worker's fault prefix: wait HOLD_S before the pull
HOLD_S = 600.0  # longer than any test: a held request ends only when it is cancelled
LIMIT = 2
IN_FLIGHT = "splitserve_router_requests_in_flight"
REFUSAL = "requests in flight, the limit per caller; wait for one to finish"


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("caller_concurrency")
    keys = {n: f"{n}-{secrets.token_urlsafe(24)}" for n in ("a", "b")}
    (work / "api-keys").write_text(f"{keys['a']}\n{keys['b']}\n")
    (work / "router.yaml").write_text(yaml.safe_dump({"auth": {"max_concurrent": LIMIT}}))
    with ProcessGroup(work) as procs:
        prefill, _ = start_worker(procs, "prefill", tiny_llama, wait=False)
        faults = {"delay_before_pull_s": HOLD_S, "request_id_prefix": HOLD}
        decode, _ = start_worker(procs, "decode", tiny_llama, faults, wait=False)
        prefill.wait_serving()
        decode.wait_serving()
        http_port, metrics = free_port(), free_port()
        router = procs.router(
            tiny_llama,
            *("--config", str(work / "router.yaml"), "--api-keys-file", str(work / "api-keys")),
            *("--prefill", prefill.address, "--decode", decode.address, "--model-name", "tiny"),
            *("--http-port", str(http_port), "--metrics-port", str(metrics)),
            *("--max-model-len", str(MAX_MODEL_LEN)),
        )
        yield {"keys": keys, "router": router, "prefill": prefill, "decode": decode,
               "http": http_port, "metrics": metrics}  # fmt: skip
        for p in (router, prefill, decode):
            assert p.stop() == 0, p.log()[-5000:]
            assert "Traceback" not in p.log(), p.log()[-20000:]


def _md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _post(port: int, key: str, body: dict, request_id: str | None = None):
    """A POST /v1/completions on a new connection; (connection, response), headers read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), headers)
    return conn, conn.getresponse()


def test_concurrency_limit_per_caller_end_to_end(stack):
    keys, port, router = stack["keys"], stack["http"], stack["router"]
    in_flight = lambda: metric(stack["metrics"], IN_FLIGHT)  # noqa: E731

    async def until_in_flight(n: int) -> None:
        await wait_until(lambda: in_flight() == n, 60, f"{n} requests in flight at the router")

    def hold_grpc(stub, n: int) -> list:
        """`n` gRPC streams of key A, each past its prefill (first chunk read): in flight."""
        calls = []
        for i in range(n):
            rid = f"{HOLD}-grpc-{secrets.token_hex(4)}-{i}"
            request = ids_request(CLEAN_PROMPT, greedy(8), rid)
            call = stub.Generate(request, metadata=_md(keys["a"]), timeout=300)  # never a hang
            assert next(call).request_id == rid
            calls.append(call)
        return calls

    def refused(stub) -> None:
        """Key A's next request, gRPC and HTTP, is refused and says how to get in."""
        call = stub.Generate(
            ids_request(CLEAN_PROMPT, greedy(4)), metadata=_md(keys["a"]), timeout=60
        )
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert REFUSAL in err.value.details() and f"{LIMIT} requests" in err.value.details()
        assert int(dict(err.value.trailing_metadata())["retry-after-ms"]) >= 1000
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        conn, resp = _post(port, keys["a"], body)
        try:
            got = json.loads(resp.read())
        finally:
            conn.close()
        assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1, (resp.status, got)
        assert REFUSAL in got["error"]["message"], got

    def served(stub, key: str) -> None:
        chunks = list(
            stub.Generate(ids_request(CLEAN_PROMPT, greedy(4)), metadata=_md(key), timeout=60)
        )
        assert sum(len(c.token_ids) for c in chunks) == 4
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        conn, resp = _post(port, key, body)
        try:
            assert resp.status == 200, resp.read()[:300]
            assert json.loads(resp.read())["usage"]["completion_tokens"] >= 1
        finally:
            conn.close()

    calls, conns = [], []
    try:
        with grpc.insecure_channel(router.address) as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            # A's two slots: a gRPC stream past its prefill, and an HTTP stream (its events may
            # wait for text that only decoding makes): both counted in flight by the router
            calls += hold_grpc(stub, 1)
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
            conn, resp = _post(port, keys["a"], body, request_id=f"{HOLD}-http")
            conns.append(conn)
            assert resp.status == 200
            asyncio.run(until_in_flight(LIMIT))
            refused(stub)
            served(stub, keys["b"])  # another caller has slots of its own
            assert in_flight() == LIMIT

            conn.close()  # the HTTP client goes away: its slot comes back
            asyncio.run(until_in_flight(LIMIT - 1))
            served(stub, keys["a"])
            calls.pop().cancel()
            asyncio.run(until_in_flight(0))

            # both slots back, exactly: A holds two again, and the third is refused again
            calls += hold_grpc(stub, LIMIT)
            asyncio.run(until_in_flight(LIMIT))
            refused(stub)
            while calls:
                calls.pop().cancel()
            asyncio.run(until_in_flight(0))
            served(stub, keys["a"])
    finally:  # a failure must not leave held requests behind for the teardown's drain
        for call in calls:
            call.cancel()
        for conn in conns:
            conn.close()

    prefill, decode = stack["prefill"], stack["decode"]
    asyncio.run(assert_workers_free([prefill.address], [decode.address], timeout=60))
    for p in (router, prefill, decode):
        assert health_status(p.address, p.service) == SERVING, p.name
