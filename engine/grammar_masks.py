"""Host side of structured output: each constrained row's next-token bitmask from its matcher.

One bitmask row per sampled row, [n, W] int32 with W = ceil(vocab / 32) (kernels/
token_bitmask.py reads it): all ones (-1) for an unconstrained row, the matcher's allowed
tokens for a constrained one. llguidance computes the constrained rows in parallel on its own
threads (`LLExecutor`, `executor_threads()`), outside the GIL.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import llguidance
import numpy as np
import torch
from llguidance.numpy import fill_next_token_bitmask_par

from splitserve.engine.side_thread import SideThread

_EXECUTOR: llguidance.LLExecutor | None = None


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


# batch 64 of the benchmark schema on the H100 host (16 CPUs), ratio to unconstrained with
# 4 / 8 / 12 / 16 threads: 1.49 / 1.31 / 1.26 / 1.19-1.24 (benchmarks/results/h100-2026-12-07b)
MAX_FILL_THREADS = 16
# independent compiles of a grammar per fill thread (request/grammar_cache.py: copies of one
# compile fill their masks one at a time), so rows of one schema seldom share a lock
LINEAGES_PER_THREAD = 4


def executor_threads() -> int:
    """Threads that fill a batch's masks: the CPUs this process may run on (its affinity, as a
    container or `taskset` sets it), at most MAX_FILL_THREADS. A row inside a bounded string
    walks the whole token trie (~1.5-2.5 ms at 128k tokens on one core), so a step of 32
    distinct rows sums to several ms; threads split it only across independent compiles
    (grammar_lineages). The earlier finding that 1-4 threads beat 12-16 was measured on copies
    of one compile, which fill one at a time whatever the thread count. (Our own row-at-a-time
    threads, costliest row first, were slower than llguidance's rayon pool on the H100 host:
    1.29-1.32x against 1.21-1.24x at 16 threads; docs/structured_output.md.)"""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_FILL_THREADS, cpus))


def grammar_lineages() -> int:
    """How many independent compiles of one grammar the engine's GrammarCache keeps."""
    return LINEAGES_PER_THREAD * executor_threads()


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor(executor_threads())
    return _EXECUTOR


def fill_masks(
    matchers: Sequence[object | None],
    out: np.ndarray,
    same_as: Sequence[int | None] | None = None,
    beside: Callable[[], None] | None = None,
    side: SideThread | None = None,
) -> float:
    """out[i] <- row i's mask: matchers[i]'s next allowed tokens, or all ones for None and for
    a matcher in an error state (its engine ends that request when it consumes the token; one
    request's failure must not fail the batch).

    same_as[i] = j < i says row i's matcher stands in the same state as row j's (same grammar,
    same tokens consumed: the caller proves it), so row i copies row j's mask instead of walking
    the token trie again: rows of one schema share their forced opening, `n` choices of one
    prompt share theirs, and a state inside a bounded string costs ~1-2 ms at 128k tokens.

    `beside` (Python work that touches none of these matchers) runs on `side`'s thread while
    llguidance fills (the GIL released), or here after the fill when there is no `side` or no
    row to walk. Returns the seconds the fill itself took (not `beside`)."""
    n = len(matchers)
    out[:n] = -1
    rows, copies = [], []
    for i, m in enumerate(matchers):
        if m is None or m.is_error():
            continue
        j = same_as[i] if same_as is not None else None
        if j is None:
            rows.append((m, i))
        else:
            copies.append((i, j))
    t0 = time.perf_counter()

    def fill() -> float:  # the moment the fill ended (`beside` may still run after it)
        fill_next_token_bitmask_par(_executor(), rows, out[:n])
        return time.perf_counter()

    if rows and beside is not None and side is not None:
        took = side.beside(beside, fill) - t0
        beside = None
    else:
        took = (fill() if rows else time.perf_counter()) - t0
    if beside is not None:
        beside()
    t1 = time.perf_counter()
    for i, j in copies:
        out[i] = out[j]
    return took + time.perf_counter() - t1


def host_masks(matchers: Sequence[object | None], vocab: int, device: torch.device) -> torch.Tensor:
    """The masks of `matchers` as a device tensor [n, W] (the host sampling paths)."""
    out = np.empty((len(matchers), mask_words(vocab)), dtype=np.int32)
    fill_masks(matchers, out)
    return torch.from_numpy(out).to(device)
