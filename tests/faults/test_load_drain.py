"""Pressure and shutdown: a burst of long requests on small KV pools queues (or is refused with
RESOURCE_EXHAUSTED) without a crash or a hang; a decode worker's SIGTERM drain stops new work
going there and lets its in-flight streams finish within the grace period, none lost."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from fault_helpers import Ledger, finish_case, metric, start_on, start_worker, wait_all_healthy
from grpc_health.v1.health_pb2 import HealthCheckResponse
from helpers_procs import health_status
from router_helpers import SERVING, greedy, router_config, running_router, wait_until

from splitserve.request.sampling_params import SamplingParams

NOT_SERVING = HealthCheckResponse.NOT_SERVING
pytestmark = pytest.mark.slow  # one of the suite's slowest files (a burst on small pools, a drain)

PROMPT = [1, 44, 45, 46, 200, 201, 202]


def test_kv_pool_exhaustion_burst_queues_without_crash_or_hang(cluster, oracle, procs):
    # prefill: 39 usable blocks of 4 tokens (four 30-token prompts under lease at a time);
    # decode: 47 (two sequences of 30 + 60 tokens at a time); ten such requests at once
    prefill, _ = start_worker(procs, "prefill", cluster.model, None, num_blocks=40, wait=False)
    decode, dm = start_worker(procs, "decode", cluster.model, None, num_blocks=48, wait=False)
    prefill.wait_serving()
    decode.wait_serving()
    prompts = [[1] + [(7 * i + 13 * k) % 500 + 3 for i in range(29)] for k in range(5)] * 2
    sampling = greedy(60, ignore_eos=True)

    async def body():
        ledger = Ledger("burst")
        async with running_router(
            router_config(cluster.model, [prefill.address], [decode.address])
        ) as (r, stub):
            start = time.monotonic()
            done = await asyncio.wait_for(
                asyncio.gather(*(ledger.run(stub, p, sampling, timeout=120) for p in prompts)), 150
            )
            took = time.monotonic() - start
            pool_full = metric(dm, "splitserve_kv_transfer_failures_total", reason="pool_full")
            # streamed hand-overs (the default) wait for decode blocks (backpressure) instead of
            # recomputing; a wait past kv_transfer.stream_reserve_wait_s falls back to the pull
            waits = metric(dm, "splitserve_decode_kv_reserve_waits_total")
            pressure = pool_full + waits + metric(dm, "splitserve_decode_preemptions_total")
            alive = prefill.alive() and decode.alive()
            await finish_case(ledger, stub, oracle, [prefill.address], [decode.address], r)
            return done, took, pressure, alive, pool_full, waits

    done, took, pressure, alive, pool_full, waits = asyncio.run(body())
    assert alive and health_status(decode.address) == health_status(prefill.address) == SERVING
    statuses = [t.status for t in done]
    assert set(statuses) <= {"OK/LENGTH", "RESOURCE_EXHAUSTED"}, statuses
    assert pressure > 0 or "RESOURCE_EXHAUSTED" in statuses  # the pools did run short
    # every request recomputed for want of decode blocks says so on its last chunk
    told = [t for t in done if t.status == "OK/LENGTH" and t.chunks[-1].kv_handover.recomputed]
    everyone_served = set(statuses) == {"OK/LENGTH"}
    assert (len(told) == pool_full if everyone_served else len(told) <= pool_full) and all(
        t.chunks[-1].kv_handover.reason == "pool_full" for t in told
    ), (pool_full, [t.chunks[-1].kv_handover for t in done if t.chunks])
    # nothing lost to backpressure: every served request says how its KV arrived
    served = [t.chunks[-1].kv_handover for t in done if t.status == "OK/LENGTH"]
    assert all(h.streamed or h.recomputed or h.stream_fallback for h in served), served
    assert waits == 0 or any(h.streamed for h in served)
    for p, t in zip(prompts, done):
        if t.status == "OK/LENGTH":
            assert (
                t.tokens
                == oracle(
                    p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
                ).token_ids
            )


def test_sigterm_drain_finishes_in_flight_streams(cluster, oracle, procs):
    grace_s = 30.0
    draining, _ = start_worker(
        procs,
        "decode",
        cluster.model,
        None,
        "--drain-grace-s",
        str(grace_s),
        "--drain-announce-s",
        "3",
    )
    cfg = router_config(
        cluster.model,
        [cluster.prefill],
        [draining.address, cluster.decode],
        routing={"decode_policy": "round_robin"},
    )

    async def body():
        ledger = Ledger("drain")
        async with running_router(cfg) as (r, stub):
            await wait_all_healthy(r)
            streams = [await start_on(ledger, stub, draining.address, [cluster.decode], PROMPT)]
            streams += [
                ledger.start(stub, PROMPT) for _ in range(2)
            ]  # round robin: one more lands there
            await streams[0].read(2)
            in_flight = len(streams[0].tokens)  # the drain must overlap a running stream
            draining.proc.send_signal(signal.SIGTERM)
            termed = time.monotonic()
            await wait_until(
                lambda: _not_serving(draining.address), 5, "draining worker not SERVING"
            )
            w = r.registry.get(draining.address)
            await wait_until(
                lambda: not w.healthy, 5, "router stopped routing to the draining worker"
            )
            # evicted by the NOT_SERVING answer itself, inside the announce window: after it the
            # port closes and the reason would be a refused probe
            why = w.why
            codes = await asyncio.gather(*(t.finish() for t in streams))
            code = await asyncio.to_thread(draining.proc.wait, grace_s)
            exited_s = time.monotonic() - termed
            await finish_case(ledger, stub, oracle, [cluster.prefill], [cluster.decode], r)
            return streams, codes, code, exited_s, in_flight, why, r.metrics.evictions("decode")

    streams, codes, code, exited_s, in_flight, why, evictions = asyncio.run(body())
    assert why == "health is NOT_SERVING" and evictions == {"not_serving": 1}, (why, evictions)
    want = oracle(PROMPT, SamplingParams(temperature=0, max_tokens=249, ignore_eos=True)).token_ids
    assert codes == [grpc.StatusCode.OK] * 3 and all(t.tokens == want for t in streams)
    assert code == 0 and exited_s < grace_s
    assert (
        2 <= in_flight < len(want)
    )  # SIGTERM came mid-stream; that stream still ended OK, complete


async def _not_serving(address: str) -> bool:
    # NOT_SERVING exactly: a worker that died or stopped answering would not count as draining
    return (
        await asyncio.to_thread(health_status, address, "splitserve.v1.DecodeWorker", 1.0)
        == NOT_SERVING
    )
