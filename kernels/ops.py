"""The op layer the engine calls: one function per hot-path op, dispatched by device.

Signatures and shapes are documented in `reference.py`. Triton modules are imported lazily
so that a CPU-only process never compiles a kernel.
"""

from __future__ import annotations

import torch

from splitserve.kernels import reference
from splitserve.kernels.dispatch import use_triton


def _triton():
    from splitserve.kernels import triton_ops

    return triton_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    impl = _triton() if use_triton(x) else reference
    return impl.rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    impl = _triton() if use_triton(x) else reference
    return impl.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    impl = _triton() if use_triton(x) else reference
    return impl.silu_and_mul(x)


def apply_rope(q, k, positions, cos_sin_cache):
    impl = _triton() if use_triton(q) else reference
    return impl.apply_rope(q, k, positions, cos_sin_cache)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    impl = _triton() if use_triton(k) else reference
    impl.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    impl = _triton() if use_triton(q) else reference
    return impl.rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float):
    impl = _triton() if use_triton(q) else reference
    return impl.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len: int, scale: float):
    impl = _triton() if use_triton(q) else reference
    return impl.prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len, scale
    )


def pack_kv_blocks(kv_cache, block_ids, out=None):
    impl = _triton() if use_triton(kv_cache) else reference
    return impl.pack_kv_blocks(kv_cache, block_ids, out)


def unpack_kv_blocks(packed, kv_cache, block_ids) -> None:
    impl = _triton() if use_triton(kv_cache) else reference
    impl.unpack_kv_blocks(packed, kv_cache, block_ids)
