"""The per-request timings a Prefill reply carries: queue, compute, the first token's sampling
(part of compute) and the start of the hand-over (arrival to the lease grant); and the wait from
the lease grant to the first pull of its KV (a metric: it happens after the reply)."""

from __future__ import annotations

import asyncio

from prefill_helpers import prefill_request, serving, worker_config

from splitserve.protos import generate_pb2

SEEDED = generate_pb2.SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=8)
ONE_TOKEN = generate_pb2.SamplingParams(temperature=0.0, max_tokens=1)


def test_reply_reports_sampling_and_the_start_of_the_hand_over(tiny_llama):
    async def run():
        async with serving(worker_config(tiny_llama, budget=8)) as (worker, stub):
            resp = await stub.Prefill(prefill_request("a", list(range(1, 30)), SEEDED))
            assert resp.HasField("kv")
            assert 0 < resp.sampling_time_ms <= resp.compute_time_ms
            # the lease comes after queue + compute, and not absurdly later (huge margin: CI)
            assert resp.queue_time_ms + resp.compute_time_ms <= resp.handover_start_ms
            assert resp.handover_start_ms < resp.queue_time_ms + resp.compute_time_ms + 5000
            source = worker.kv_server.leases  # the listener's own lease source: a pull's start
            waits = "splitserve_prefill_handover_wait_seconds_count"
            source.begin_pull(resp.kv.lease_id, "a")
            source.begin_pull(resp.kv.lease_id, "a")  # a concurrent retry starts nothing new
            assert worker.metrics.registry.get_sample_value(waits) == 1
            source.end_pull(resp.kv.lease_id, delivered=False)
            source.end_pull(resp.kv.lease_id, delivered=True)  # delivered: the lease is released
            assert len(worker.engine.leases) == 0
            done = await stub.Prefill(prefill_request("b", [5, 6, 7], ONE_TOKEN))
            assert not done.HasField("kv") and done.handover_start_ms == 0
            assert done.sampling_time_ms > 0
            sampled = worker.metrics.registry.get_sample_value(
                "splitserve_prefill_sampling_seconds_count"
            )
            assert sampled == 2

    asyncio.run(run())
