"""Cancels, aborts and deadlines at each stage of a request, on the shared workers (their test-only
faults slow a prompt's last chunk or hold a decode admission, only for ids with a prefix):
each ends in its one status, frees every block at once (not at a lease's TTL), and the next
request is served exactly as before."""

from __future__ import annotations

import asyncio
import time

import grpc
from fault_helpers import (
    LAST_CHUNK_S,
    PULL_DELAY_S,
    REPLY_DELAY_S,
    SLOW_PREFILL,
    SLOW_PULL,
    Ledger,
    finish_case,
    leases_held,
    metric,
    wait_no_lease,
)
from router_helpers import (
    MAX_MODEL_LEN,
    assert_workers_free,
    greedy,
    router_config,
    running_router,
    wait_until,
    worker_load,
)

from splitserve.protos import generate_pb2

PROMPT = [1, 44, 45, 46, 200, 201, 202]
PROMPT40 = [1] + list(range(60, 99))  # three chunks at the shared prefill worker's budget of 16
LONG40 = greedy(MAX_MODEL_LEN - len(PROMPT40), ignore_eos=True)  # up to max_model_len, no more
GRPC_ROUNDING_S = 0.02  # gRPC encodes a timeout rounded up to a few significant digits
STEP_BOUND_S = 2.0  # one decode step (ms) plus the cancel's two gRPC hops, on a busy 2-core machine


def _router(cluster, streaming: bool = True):
    # streaming False: the pull after the prefill (these cases time its pull delay)
    routing = {"kv_streaming": streaming}
    return running_router(
        router_config(cluster.model, [cluster.prefill], [cluster.decode], routing=routing)
    )


def test_client_cancel_mid_decode_stream(cluster, oracle):
    async def body():
        ledger = Ledger("cancel")
        async with _router(cluster) as (r, stub):
            aborted = metric(
                cluster.decode_metrics, "splitserve_decode_requests_finished_total", reason="abort"
            )
            t = ledger.start(stub, PROMPT)
            await t.read(3)
            assert (
                await leases_held(cluster.prefill) == 0
            )  # the pull already released the prefill lease
            t.call.cancel()
            assert await t.finish() == grpc.StatusCode.CANCELLED
            start = time.monotonic()
            await assert_workers_free([], [cluster.decode], timeout=STEP_BOUND_S)
            freed_s = time.monotonic() - start
            assert (
                metric(
                    cluster.decode_metrics,
                    "splitserve_decode_requests_finished_total",
                    reason="abort",
                )
                == aborted + 1
            )  # ended as cancelled, not by running to 249 tokens
            assert 3 <= len(t.tokens) < 249
            await finish_case(ledger, stub, oracle, [cluster.prefill], [cluster.decode], r)
            return freed_s

    assert asyncio.run(body()) < STEP_BOUND_S


def test_client_cancel_before_decode_admission_releases_the_lease_at_once(cluster, oracle):
    async def body():
        ledger = Ledger(
            f"{SLOW_PULL}-cancel"
        )  # the decode worker holds it PULL_DELAY_S before pulling
        async with _router(cluster, streaming=False) as (r, stub):
            t = ledger.start(stub, PROMPT)
            await t.read(1)  # the first token: prefill done, its lease held for the pull
            assert await leases_held(cluster.prefill) == 1
            await asyncio.sleep(
                0.2
            )  # Decode is open on the worker, blocks reserved, pull not started
            t.call.cancel()
            cancelled_at = time.monotonic()
            assert await t.finish() == grpc.StatusCode.CANCELLED
            await wait_no_lease(cluster.prefill, 1.0)  # released by the router
            released_s = time.monotonic() - cancelled_at
            # the router counts the release when ReleaseLease answers, in a background task:
            # the worker can show the lease gone a moment before that answer is handled
            counter = r.metrics.leases_released.labels("request_ended")
            deadline = time.monotonic() + 10.0
            while counter._value.get() < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            ended = counter._value.get()
            await finish_case(ledger, stub, oracle, [cluster.prefill], [cluster.decode], r)
            return released_s, ended

    released_s, ended = asyncio.run(body())
    assert (
        released_s < PULL_DELAY_S and ended == 1
    )  # released by the router, long before any TTL (30 s)


def test_abort_during_the_last_prefill_chunk(cluster, oracle):
    async def body():
        ledger = Ledger(f"{SLOW_PREFILL}-abort")  # its last chunk's step sleeps LAST_CHUNK_S
        async with _router(cluster) as (r, stub):
            before = _prefill_outcomes(cluster, "cancelled"), _prefill_outcomes(cluster, "leased")
            steps = _prefill_steps(cluster)
            t = ledger.start(stub, PROMPT40, LONG40)
            await wait_until(_running(cluster.prefill), 5, "prefill started")
            # chunks 1 and 2 done (their steps counted); the last one's step is sleeping now
            await wait_until(
                lambda: _prefill_steps(cluster) >= steps + 2, 10, "two prefill chunks done"
            )
            assert _prefill_steps(cluster) == steps + 2
            assert (
                await stub.Abort(generate_pb2.AbortRequest(request_id=t.request_id), timeout=5)
            ).found
            assert await t.finish() == grpc.StatusCode.OK
            assert t.status == "OK/ABORT" and t.tokens == []
            await assert_workers_free([cluster.prefill], [], timeout=LAST_CHUNK_S + 5)
            after = _prefill_outcomes(cluster, "cancelled"), _prefill_outcomes(cluster, "leased")
            await finish_case(ledger, stub, oracle, [cluster.prefill], [cluster.decode], r)
            return before, after

    (cancelled0, leased0), (cancelled1, leased1) = asyncio.run(body())
    assert (
        cancelled1 == cancelled0 + 1 and leased1 == leased0
    )  # freed after its step; no lease was granted


def _prefill_steps(cluster) -> float:
    return metric(cluster.prefill_metrics, "splitserve_prefill_batch_tokens_count")


def _prefill_outcomes(cluster, outcome: str) -> float:
    return metric(cluster.prefill_metrics, "splitserve_prefill_requests_total", outcome=outcome)


def test_deadline_while_the_prefill_reply_is_on_the_wire_drops_its_lease(cluster, oracle):
    """The prefill granted a lease but its reply is slow (test-only reply delay) and the deadline
    passes first: nobody can pull it; the router's Abort frees it at once, not at its TTL (30 s)."""

    async def body():
        ledger = Ledger("wire")
        async with _router(cluster) as (r, stub):
            leased = _prefill_outcomes(cluster, "leased")
            t = ledger.start(
                stub,
                PROMPT,
                timeout=LAST_CHUNK_S + REPLY_DELAY_S / 2,
                request_id=f"{SLOW_PREFILL}-wire",
            )
            assert await t.finish() == grpc.StatusCode.DEADLINE_EXCEEDED and not t.tokens
            assert (
                _prefill_outcomes(cluster, "leased") == leased + 1
            )  # granted, then lost on the wire
            await assert_workers_free([cluster.prefill], [], timeout=3)
            await finish_case(ledger, stub, oracle, [cluster.prefill], [cluster.decode], r)

    asyncio.run(body())


def _running(address: str):
    async def check() -> bool:
        return (await worker_load(address, "prefill")).num_running > 0

    return check


class TimeoutSpy:
    """Wraps a worker's stub in the router: records the timeout of each call, then makes it."""

    def __init__(self, stub, seen: list[tuple[str, float | None]]) -> None:
        self._stub, self._seen = stub, seen

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)

        def call(request, timeout=None, **kw):
            self._seen.append((name, timeout))
            return method(request, timeout=timeout, **kw)

        return call


def test_deadline_shrinks_at_each_hop_and_stops_the_work(cluster, oracle):
    async def body():
        ledger = Ledger("deadline")
        async with _router(cluster, streaming=False) as (r, stub):
            seen: list = []
            for address in (cluster.prefill, cluster.decode):
                w = r.registry.get(address)
                w.stub = TimeoutSpy(w.stub, seen)
            # 50 ms: expires inside the prefill (its last chunk sleeps LAST_CHUNK_S)
            cancelled = _prefill_outcomes(cluster, "cancelled")
            t = ledger.start(
                stub, PROMPT40, LONG40, timeout=0.05, request_id=f"{SLOW_PREFILL}-deadline"
            )
            assert await t.finish() == grpc.StatusCode.DEADLINE_EXCEEDED and not t.tokens
            first = [s for s in seen if s[0] in ("Prefill", "Decode")]
            seen.clear()
            await assert_workers_free(
                [cluster.prefill], [], timeout=LAST_CHUNK_S + 5
            )  # stopped after its step
            assert _prefill_outcomes(cluster, "cancelled") == cancelled + 1
            # 1 s: prefill returns; expires while the decode worker holds the request before its pull
            t = ledger.start(stub, PROMPT, timeout=1.0, request_id=f"{SLOW_PULL}-deadline")
            assert await t.finish() == grpc.StatusCode.DEADLINE_EXCEEDED and len(t.tokens) == 1
            second = [s for s in seen if s[0] in ("Prefill", "Decode")]
            await finish_case(ledger, stub, oracle, [cluster.prefill], [cluster.decode], r)
            return first, second

    first, second = asyncio.run(body())
    # the router's first hop gets what the client gave, up to gRPC's timeout encoding (it rounds
    # the header up to a few significant digits); each later hop gets less than the one before
    assert [n for n, _ in first] == ["Prefill"] and 0 < first[0][1] < 0.05 + GRPC_ROUNDING_S, first
    (p, prefill_t), (d, decode_t) = second
    assert (p, d) == ("Prefill", "Decode") and 0 < decode_t < prefill_t < 1.0 + GRPC_ROUNDING_S, (
        second
    )
