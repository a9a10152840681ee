"""The op layer the engine calls: one function per hot-path op, dispatched by device.

Signatures and shapes are documented in `reference.py`. Triton modules are imported lazily
so that a CPU-only process never compiles a kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.kernels import reference
from splitserve.kernels.dispatch import use_triton

# Token counts up to this take the Triton small-M GEMV kernels (decode at batch 1..4); larger
# ones compose the norm / activation kernel with a cuBLAS matmul (unchanged prefill path).
SMALL_M_MAX = 4


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


def prefill_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    max_query_len: int,
    scale: float,
    out=None,
):
    impl = _triton() if use_triton(q) else reference
    return impl.prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len, scale, out
    )


def pack_kv_blocks(kv_cache, block_ids, out=None):
    impl = _triton() if use_triton(kv_cache) else reference
    return impl.pack_kv_blocks(kv_cache, block_ids, out)


def unpack_kv_blocks(packed, kv_cache, block_ids) -> None:
    impl = _triton() if use_triton(kv_cache) else reference
    impl.unpack_kv_blocks(packed, kv_cache, block_ids)


def _small_m(x: torch.Tensor) -> bool:
    """Few enough tokens for the GEMV kernels (a shape test: safe inside a CUDA graph)."""
    return use_triton(x) and x.numel() <= SMALL_M_MAX * x.shape[-1]


def fused_add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias=None):
    """(rms_norm(x + residual) @ weight.T + bias, x + residual); residual None: plain norm."""
    if _small_m(x):
        return _triton().fused_add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
    if residual is None:
        normed, summed = rms_norm(x, norm_weight, eps), x
    else:
        normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), summed


def silu_mul_linear(gate_up, weight, bias=None):
    if _small_m(gate_up):
        return _triton().silu_mul_linear(gate_up, weight, bias)
    return F.linear(silu_and_mul(gate_up), weight, bias)


def linear_small_m(x, weight, bias=None, gemv: bool = True):
    """x @ weight.T + bias: the Triton GEMV at small M when `gemv`, else cuBLAS / torch."""
    if gemv and _small_m(x):
        return _triton().linear_small_m(x, weight, bias)
    return F.linear(x, weight, bias)
