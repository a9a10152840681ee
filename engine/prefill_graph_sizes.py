"""The token counts piecewise prefill graphs are captured at (engine/prefill_graphs.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)


def default_sizes(max_tokens: int, smallest: int = 16, largest: int = 8192) -> list[int]:
    """Powers of two from `smallest` to `largest`, none above the step budget `max_tokens`."""
    out, n = [], smallest
    while n <= min(largest, max_tokens):
        out.append(n)
        n *= 2
    return out


def graph_sizes(sizes: Sequence[int] | None, max_num_batched_tokens: int) -> list[int]:
    """`sizes` (None: default_sizes) to capture: no step exceeds the budget, so a count above it
    is captured as the budget itself (the steps it would serve keep a graph, padded less)."""
    if not sizes:
        return default_sizes(max_num_batched_tokens)
    if over := sorted(s for s in sizes if s > max_num_batched_tokens):
        log.info("prefill graph sizes %s captured at the budget %d", over, max_num_batched_tokens)
    return sorted({min(s, max_num_batched_tokens) for s in sizes if s >= 1})
