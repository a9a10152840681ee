"""Host side of structured output: each constrained row's next-token bitmask from its matcher.

One bitmask row per sampled row, [n, W] int32 with W = ceil(vocab / 32) (kernels/
token_bitmask.py reads it): all ones (-1) for an unconstrained row, the matcher's allowed
tokens for a constrained one. Rows fill in parallel outside the GIL (`MaskFiller`): one row
at a time per thread, the rows that cost most last step first, so a step's fill takes about
as long as its slowest row instead of its slowest thread's share of a fixed split.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import llguidance
import numpy as np
import torch
from llguidance.numpy import fill_next_token_bitmask_par

_EXECUTOR: llguidance.LLExecutor | None = None


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


MAX_FILL_THREADS = 8
# independent compiles of a grammar per fill thread (request/grammar_cache.py: copies of one
# compile fill their masks one at a time), so rows of one schema seldom share a lock
LINEAGES_PER_THREAD = 4


def executor_threads() -> int:
    """Threads that fill a batch's masks: the CPUs this process may run on (its affinity, as a
    container or `taskset` sets it), at most MAX_FILL_THREADS. A row inside a bounded string
    walks the whole token trie (~1.5-2.5 ms at 128k tokens on one core), so a step of 32
    distinct rows sums to several ms; threads split it only across independent compiles
    (grammar_lineages). The earlier finding that 1-4 threads beat 12-16 was measured on copies
    of one compile, which fill one at a time whatever the thread count."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_FILL_THREADS, cpus))


def grammar_lineages() -> int:
    """How many independent compiles of one grammar the engine's GrammarCache keeps."""
    return LINEAGES_PER_THREAD * executor_threads()


# "rows": MaskFiller's own threads, one row at a time, costliest first; "rayon": llguidance's
# fill_next_token_bitmask_par, which splits the rows into fixed contiguous runs per thread
# (benchmarks/decode.py --fill-mode compares them)
FILL_MODE = "rows"


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor(executor_threads())
    return _EXECUTOR


class MaskFiller:
    """Fills many rows' masks on `threads` threads, the caller being one of them. Each thread
    takes the next row from one list (a row inside a bounded string costs 1-2 ms at 128k
    tokens, most rows ~15 us, so a fixed split of the rows can put two slow ones on one
    thread while the others idle); the list starts with the rows that cost most last time, by
    matcher (a row's state changes little in one token). llguidance's compute drops the GIL."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or executor_threads()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # one fill at a time per filler (its cost memo)
        self._cost: dict[int, float] = {}  # id(matcher) -> seconds, rows of the last fill
        self._closed = False

    def fill(self, rows: Sequence[tuple[object, int]], out: np.ndarray) -> None:
        """out[i] <- matcher's mask for each (matcher, i); `out` C-contiguous int32 [n, W]."""
        if (
            not (out.ndim == 2 and out.flags.c_contiguous and out.flags.writeable)
            or out.dtype != np.int32
        ):
            raise ValueError("masks must be a writeable C-contiguous int32 [rows, words] array")
        if any(not 0 <= i < out.shape[0] for _, i in rows):
            raise ValueError(f"a row index outside the {out.shape[0]} mask rows")
        base, nbytes = out.ctypes.data, out.shape[1] * 4
        with self._lock:
            if self._closed:
                raise RuntimeError("the mask filler is closed")
            last = self._cost
            todo = iter(sorted(rows, key=lambda r: -last.get(id(r[0]), 0.0)))
            cost: dict[int, float] = {}

            def work() -> None:
                for m, i in todo:  # (the GIL makes next() on one iterator safe)
                    t = time.perf_counter()
                    m.unsafe_compute_mask_ptr(base + i * nbytes, nbytes)
                    cost[id(m)] = time.perf_counter() - t

            helpers = min(self.threads, len(rows)) - 1
            futures = []
            try:
                if helpers > 0 and self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        self.threads - 1, thread_name_prefix="mask-fill"
                    )
                for _ in range(helpers):
                    futures.append(self._pool.submit(work))
                work()
            finally:  # every helper done before `out` is read, reused or freed
                errors = [f.exception() for f in futures]
            self._cost = cost
        for e in errors:
            if e is not None:
                raise e

    def close(self) -> None:
        """Stops the helper threads (after a fill in flight); later fills are refused."""
        with self._lock:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


_FILLER: MaskFiller | None = None


def _default_filler() -> MaskFiller:
    global _FILLER
    if _FILLER is None:
        _FILLER = MaskFiller()
    return _FILLER


def fill_masks(
    matchers: Sequence[object | None],
    out: np.ndarray,
    same_as: Sequence[int | None] | None = None,
    filler: MaskFiller | None = None,
) -> None:
    """out[i] <- row i's mask: matchers[i]'s next allowed tokens, or all ones for None and for
    a matcher in an error state (its engine ends that request when it consumes the token; one
    request's failure must not fail the batch). `filler`: whose threads (default: a shared one).

    same_as[i] = j < i says row i's matcher stands in the same state as row j's (same grammar,
    same tokens consumed: the caller proves it), so row i copies row j's mask instead of walking
    the token trie again: rows of one schema share their forced opening, `n` choices of one
    prompt share theirs, and a state inside a bounded string costs ~1-2 ms at 128k tokens."""
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
    if rows and FILL_MODE == "rayon":
        fill_next_token_bitmask_par(_executor(), rows, out[:n])
    elif rows:
        (filler or _default_filler()).fill(rows, out)
    for i, j in copies:
        out[i] = out[j]


def host_masks(matchers: Sequence[object | None], vocab: int, device: torch.device) -> torch.Tensor:
    """The masks of `matchers` as a device tensor [n, W] (the host sampling paths)."""
    out = np.empty((len(matchers), mask_words(vocab)), dtype=np.int32)
    fill_masks(matchers, out)
    return torch.from_numpy(out).to(device)
