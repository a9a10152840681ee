"""RoPE (NeoX / HF rotate-half), paged KV-cache writes, and the fused RoPE + KV write.

One program per token handles every head of that token, so the cos/sin row is loaded once
and the k/v rows go straight to their cache slot. Partial rotary (R = 2*HALF < D) copies the
tail dims unchanged. Rounding matches the reference: rotate in fp32, round to the input
dtype, then (for cache writes) convert to the cache dtype.

This module holds the Python launchers (strides, block sizes, the grid); the @triton.jit
kernel bodies are in triton_rope_cache_kernels.py.
"""

from __future__ import annotations

import torch

from splitserve.kernels.triton_common import pow2
from splitserve.kernels.triton_rope_cache_kernels import rope_kernel, write_kv_kernel


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _cache_strides(c: torch.Tensor) -> tuple[int, int, int]:
    assert c.dim() == 4 and c.stride(-1) == 1, (
        "cache must be [NB, BS, Hkv, D] with a unit last stride"
    )
    return c.stride(0), c.stride(1), c.stride(2)


def _rope(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """Shared launcher: with a cache, rotated k and v go to the cache (returns q_rot, None)."""
    q, k = _unit_last(q), _unit_last(k)
    num_t, hq, d = q.shape
    hkv = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    assert rot % 2 == 0 and rot <= d, f"cos_sin_cache width {rot} must be even and <= head_dim {d}"
    cs = _unit_last(cos_sin_cache)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    write = k_cache is not None
    k_out = None if write else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_t == 0:
        return q_out, k_out
    if write:
        v = _unit_last(v)
        kc, vc = _cache_strides(k_cache), _cache_strides(v_cache)
        bs = k_cache.shape[1]
        ko, sko, vv, sv = k_cache, (0, 0), v, (v.stride(0), v.stride(1))
    else:
        kc = vc = (0, 0, 0)
        bs = 1
        ko, sko, vv, sv = k_out, (k_out.stride(0), k_out.stride(1)), k, (0, 0)
        k_cache = v_cache = slot_mapping = k  # unused pointers
    half = rot // 2
    rope_kernel[(num_t,)](
        q,
        k,
        vv,
        positions,
        cs,
        q_out,
        ko,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        *sv,
        q_out.stride(0),
        q_out.stride(1),
        *sko,
        cs.stride(0),
        *kc,
        *vc,
        hq,
        hkv,
        HALF=half,
        D=d,
        BS=bs,
        BLOCK_HQ=pow2(hq),
        BLOCK_HKV=pow2(hkv),
        BLOCK_HALF=pow2(half),
        BLOCK_TAIL=pow2(d - 2 * half),
        BLOCK_D=pow2(d),
        WRITE_CACHE=write,
        num_warps=4 if hq * d <= 4096 else 8,
    )
    return q_out, k_out


def apply_rope(q, k, positions, cos_sin_cache):
    return _rope(q, k, None, positions, cos_sin_cache, None, None, None)


def rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    q_out, _ = _rope(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return q_out


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    k, v = _unit_last(k), _unit_last(v)
    num_t, hkv, d = k.shape
    if num_t == 0:
        return
    kc, vc = _cache_strides(k_cache), _cache_strides(v_cache)
    write_kv_kernel[(num_t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *kc,
        *vc,
        hkv,
        D=d,
        BS=k_cache.shape[1],
        BLOCK_HKV=pow2(hkv),
        BLOCK_D=pow2(d),
        num_warps=4,
    )
