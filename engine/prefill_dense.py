"""Dense attention for a fresh single prompt in the piecewise prefill graphs: which steps take
it, the lengths it runs at, and the start-up that checks it and builds its cuDNN plans
(engine/prefill_graphs.py calls it; kernels/dense_attention.py computes it)."""

from __future__ import annotations

import logging
import os
import threading

from splitserve.kernels.dense_attention import dense_causal_attention, dense_disagrees

log = logging.getLogger(__name__)

# From this bucket up a fresh single prompt's attention runs dense. Above FUSED_MAX_TOKENS the
# plain pieces launch attention eagerly anyway; from 512 the fused pieces would give way to
# them (measured per layer, not yet end to end). SPLITSERVE_DENSE_MIN_TOKENS sets it for an A/B
# (benchmarks/prefill.py --dense-min-tokens; a value above every bucket turns dense off).
_ENV = os.environ.get("SPLITSERVE_DENSE_MIN_TOKENS", "").strip()
if _ENV and not _ENV.isdigit():
    raise ValueError(f"SPLITSERVE_DENSE_MIN_TOKENS must be a token count, got {_ENV!r}")
DENSE_MIN_TOKENS = int(_ENV or 2048)


def dense_step(bucket: int) -> int:
    """The granularity a fresh prompt in `bucket` is padded to for its dense attention."""
    return max(256, bucket // 16)


def dense_len(bucket: int, tokens: int) -> int:
    step = dense_step(bucket)
    return min(bucket, -(-tokens // step) * step)


def dense_lengths(sizes: list[int]) -> list[int]:
    """Every length a dense call runs at, for piecewise graphs of these bucket `sizes`."""
    out: set[int] = set()
    for p, n in zip([0, *sizes], sizes):
        if n >= DENSE_MIN_TOKENS:
            out.update(dense_len(n, t) for t in range(p + 1, n + 1))
    return sorted(out)


def check_dense(graphs) -> bool:
    """Whether a PrefillGraphs' fresh prompts may run dense: it has a bucket for it and the
    dense call agrees with the varlen kernel on its shapes (a random prompt of the shortest
    dense length); False, with one log line, where the call fails or disagrees. Once, at
    capture: a backend computing something else on an untested GPU turns the path off."""
    lengths = dense_lengths(graphs.sizes)
    if not lengths:
        return False
    kv, scale = graphs.kv_cache[0], graphs.model.layers[0].scale
    try:
        bad = dense_disagrees(graphs.q, kv.shape[-2], kv.shape[-3], scale, lengths[0])
    except Exception as exc:  # e.g. no cuDNN attention for this GPU / dtype / head size
        bad = str(exc).splitlines()[0]
    if bad:
        log.warning("dense prefill attention off, the varlen kernel serves: %s", bad)
    return not bad


def build_dense_plans(graphs) -> bool:
    """One dense call per length a PrefillGraphs runs it at, on the calling thread: each cuDNN
    plan built now, not while a user waits, and for this thread (torch keeps them per thread:
    call it where steps run). False, with one log line, where a call fails."""
    kv, scale = graphs.kv_cache[0], graphs.model.layers[0].scale
    try:
        for m in dense_lengths(graphs.sizes):
            sl = graphs.slot_mapping[:m]
            dense_causal_attention(graphs.q[:m], kv[0], kv[1], sl, scale, graphs.attn[:m])
    except Exception as exc:
        log.warning("dense prefill attention off, the varlen kernel serves: %s", exc)
        return False
    graphs.dense_threads.add(threading.get_ident())
    return True
