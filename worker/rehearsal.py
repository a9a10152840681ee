"""What the two workers' start-up rehearsals share (prefill_worker/rehearsal.py,
decode_worker/rehearsal.py): whether one runs, its prompt lengths, its prompts and sampling, and
the log line benchmarks/prefill_fast.py reads. Each worker keeps its own request path and cap."""

from __future__ import annotations

import logging
import time

from splitserve.engine.prefill_warmup import token_buckets
from splitserve.request.sampling_params import SamplingParams

# greedy (no seed drawn: the sampler's random stream is untouched), two tokens: a first token,
# then a lease (prefill) or one decode step (decode)
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def wanted(setting: bool | None, device_type: str) -> bool:
    """The config's `rehearsal`; None means on CUDA only (CPU start-ups stay quick in tests)."""
    return device_type == "cuda" if setting is None else setting


def sizes_up_to(n: int) -> list[int]:
    """The token buckets up to `n`, largest first ([] for n <= 0)."""
    return sorted(token_buckets(n, smallest=min(16, n)), reverse=True) if n > 0 else []


def prompt(n: int, vocab: int) -> list[int]:
    """An `n`-token prompt of spread-out ids, different for each length."""
    return [(7919 * j + 104729 * n) % vocab for j in range(n)]


def log_done(log: logging.Logger, sizes: list[int], start: float) -> None:
    log.info(
        "rehearsed %d requests of %d-%d tokens in %.1f ms",
        len(sizes),
        sizes[-1],
        sizes[0],
        (time.perf_counter() - start) * 1e3,
    )
