"""One request through the prefill engine's own path before SERVING (after warm-up).

Warm-up (startup.py) runs every kernel shape from the step thread, yet on the H100 the first
3,072-token prompt after SERVING still took 7-11 ms more than the next ones (issue 31's
first-prompt ratio 1.4-1.6): the device work was the same, and its extra was host CPU time at
the start of the step (`ModelRunner._step_arrays`, plain numpy over the step's token lists:
4.6-8.3 ms of thread CPU against 0.2-0.5 ms on the next step; no allocation of device or
pinned memory, no compilation, no import, no garbage collection, no lock). Requests of 16 and
512 tokens before it took only part of it away; one of the same size took all of it (whether
the cost follows the size or the largest size seen so far was not settled). So the engine
rehearses what a user's request meets at every token bucket of the step, largest first:
admission, the prefix-cache lookup, one step of N tokens for each N of `token_buckets` up to
`min(max_model_len - 2, max_num_batched_tokens)` (16, 32, ..., the largest), the first token,
the lease, its release; in a worker after its KV listener and the streamed hand-over's layer
hook are attached (worker.start_engine), as a user's first prompt meets them (the worker's first
prompt paid ~11 ms more than an in-process engine's ~3 ms: h100-2026-12-07c; the rehearsal
before them did not remove it, h100-2026-12-07e). On the GPU that is about twice the largest
step's time. SGLang sends a
warm-up request through its own server before it reports ready, and vLLM runs a dummy batch of
the largest size at start-up.

Nothing of it is left behind: its metrics go to a private registry, the prefix cache is off
while it runs (no cached entry of made-up tokens), its blocks are free again after, and the
engine zeroes the KV pool once it is over (warm-up's zeroing waits for it: engine.start).
"""

from __future__ import annotations

import logging
import time

from splitserve.kvtransfer.config import REHEARSAL_ID
from splitserve.prefill_worker.metrics import PrefillMetrics
from splitserve.worker import rehearsal as common

log = logging.getLogger(__name__)

__all__ = ["REHEARSAL_ID", "rehearsal_sizes", "rehearsal_tokens", "rehearse"]


def rehearsal_tokens(engine) -> int:
    """The rehearsal's prompt length: the largest step, within the free pool (0: none fits)."""
    sc = engine.cfg.engine.scheduler
    bs = engine.runner.block_size
    fits = (engine.allocator.num_free - 1) * bs  # one block spare for the lease's token
    return max(0, min(engine.max_model_len - 2, sc.max_num_batched_tokens, fits))


def rehearsal_sizes(engine) -> list[int]:
    """The rehearsal's prompt lengths, largest first ([]: off, or none fits)."""
    on = engine.cfg.warmup and common.wanted(engine.cfg.rehearsal, engine.runner.device.type)
    return common.sizes_up_to(rehearsal_tokens(engine)) if on else []


async def rehearse(engine, sizes: list[int]) -> None:
    """Runs the rehearsal on a started engine (the caller zeroes the pool after it)."""
    if not sizes:
        return
    metrics, cache_on = engine.metrics, engine.cache.enabled
    engine.metrics, engine.cache.enabled = PrefillMetrics(), False
    start = time.perf_counter()
    try:
        for n in sizes:
            prompt = common.prompt(n, engine.vocab_size)
            ttl = engine.cfg.lease_ttl_s
            result = await engine.prefill(REHEARSAL_ID, prompt, common.PARAMS, ttl)
            if result.lease is not None:
                engine.release_lease(result.lease.lease_id)
    finally:
        engine.metrics, engine.cache.enabled = metrics, cache_on
    common.log_done(log, sizes, start)
