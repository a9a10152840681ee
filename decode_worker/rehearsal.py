"""The decode worker's start-up rehearsal, for its local prefill (colocated prompts, recompute):
prefill_worker/rehearsal.py's reasoning and shape, through this worker's request path.

After warm-up and with the engine loop running, before SERVING: one colocated request per
token bucket of the local prefill, largest first (`min(max_model_len - 2, max_num_batched_tokens,
prefill_chunk_tokens if set)` within the free pool, then ..., 32, 16), greedy, two tokens each:
admission, the local prefill step, the first token sampled on the host, one decode step, the
finish. So a colocated worker meets its first user as warm as a prefill worker does, and the
disaggregated vs colocated comparison (benchmarks/serving_compare.py) stays even.

No trace: the engine counts into a private DecodeMetrics while it runs (the engine thread reads
`engine.metrics` at each use, but for the grammar-compile and mask-fill callbacks bound at
construction, which an unconstrained rehearsal never calls; a command through the loop after
the last finish makes sure the step that finished it is over before the real one is back, and
the real gauges are then refreshed), every block is free again, and the KV pool is zeroed after
it (warm-up leaves its zeroing to this then: one `zero_kv`, so
tensor-parallel followers freeze their heap once).
"""

from __future__ import annotations

import asyncio
import logging
import time

from splitserve.decode_worker.metrics import DecodeMetrics
from splitserve.decode_worker.sequence import DecodeInput
from splitserve.kvtransfer.config import REHEARSAL_ID
from splitserve.worker import rehearsal as common

log = logging.getLogger("splitserve.decode_worker")


def rehearsal_sizes(engine) -> list[int]:
    """The rehearsal's prompt lengths, largest first ([]: off, or none fits the pool)."""
    cfg, runner = engine.cfg, engine.runner
    budget = cfg.engine.scheduler.max_num_batched_tokens
    if cfg.prefill_chunk_tokens:  # no local prefill call is longer than a chunk
        budget = min(budget, cfg.prefill_chunk_tokens)
    # the prompt and its two tokens in the free pool (the scheduler's check_fits), any block size
    fits = engine.allocator.num_free * runner.block_size - 2
    n = max(0, min(runner.max_model_len - 2, budget, fits))
    return common.sizes_up_to(n) if common.wanted(cfg.rehearsal, runner.device.type) else []


async def rehearse(loop, engine, sizes: list[int]) -> None:
    """Runs the rehearsal through `loop` (a started EngineLoop of `engine`), then zeroes the
    pool; raises what a rehearsal request failed with."""
    if not sizes:
        return
    aio = asyncio.get_running_loop()
    vocab = engine.runner.model_config.vocab_size
    metrics = engine.metrics
    engine.metrics = DecodeMetrics()
    start = time.perf_counter()
    try:
        for n in sizes:
            done = aio.create_future()

            def sink(out, done=done) -> None:  # the engine thread
                if out.finish_reason is not None:
                    aio.call_soon_threadsafe(_settle, done, out)

            inp = DecodeInput(REHEARSAL_ID, common.prompt(n, vocab), None, common.PARAMS)
            loop.submit(inp, sink)
            out = await done
            if out.finish_reason == "error":
                raise RuntimeError(f"the start-up rehearsal failed: {out.error}")
        await asyncio.wrap_future(loop.call(lambda: None))  # its last step is over
    finally:
        engine.metrics = metrics
    await asyncio.wrap_future(loop.call(engine._snapshot))  # the real gauges: free blocks etc.
    await asyncio.wrap_future(loop.call(engine.runner.zero_kv))
    common.log_done(log, sizes, start)


def _settle(fut: asyncio.Future, out) -> None:
    if not fut.done():
        fut.set_result(out)
