"""A worker stops in a fixed order (worker/worker_skeleton.py: stop), never by garbage collection:
the stall watch first (it would flip health during the stop), then the gRPC server drains (health
NOT_SERVING, no new work, in-flight calls finish), then the UCX listener closes (no pull reads a
block the engine is about to free), then the engine. Each step is the real object's method,
recorded on the way through."""

from __future__ import annotations

import asyncio

from prefill_helpers import worker_config

from splitserve.prefill_worker.worker import PrefillWorker


def _record(order: list[str], owner, method: str, label: str) -> None:
    real = getattr(owner, method)

    async def recorded(*args, **kwargs):
        order.append(label)
        return await real(*args, **kwargs)

    setattr(owner, method, recorded)


def test_a_prefill_worker_stops_in_a_fixed_order(tiny_llama):
    async def body() -> tuple[list[str], object, object]:
        worker = PrefillWorker(worker_config(tiny_llama))
        await worker.start()
        order: list[str] = []
        _record(order, worker.watch, "stop", "stall watch")
        _record(order, worker.server, "drain", "gRPC drain")
        _record(order, worker.kv_server, "close", "UCX listener")
        _record(order, worker.engine, "stop", "engine")
        await worker.stop(grace_s=0.5)
        await worker.stop(grace_s=0.5)  # again: the closed listener is not closed twice
        return order, worker.kv_server, worker.watch

    order, kv_server, watch = asyncio.run(body())
    first, again = order[:4], order[4:]
    assert first == ["stall watch", "gRPC drain", "UCX listener", "engine"], order
    assert again == ["gRPC drain", "engine"], order  # both idempotent on their own
    assert kv_server is None and watch is None  # closed and dropped, not left to the collector
