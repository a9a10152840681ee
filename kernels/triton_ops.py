"""Triton implementations of the hot-path ops: same names and signatures as `reference.py`.

`ops.py` imports this module lazily (CUDA tensors, or CPU tensors under `force_triton()` with
TRITON_INTERPRET=1). Each op lives in a small kernel file; this module only re-exports them.
"""

from __future__ import annotations

from splitserve.kernels.triton_activation import silu_and_mul
from splitserve.kernels.triton_decode_attention import paged_decode_attention
from splitserve.kernels.triton_fused_linear import (
    fused_add_rms_norm_linear,
    linear_small_m,
    silu_mul_linear,
)
from splitserve.kernels.triton_kv_pack import pack_kv_blocks, unpack_kv_blocks
from splitserve.kernels.triton_norm import fused_add_rms_norm, rms_norm
from splitserve.kernels.triton_prefill_attention import prefill_attention
from splitserve.kernels.triton_rope_cache import apply_rope, rope_and_write_kv, write_kv_cache

__all__ = [
    "apply_rope",
    "fused_add_rms_norm",
    "fused_add_rms_norm_linear",
    "linear_small_m",
    "pack_kv_blocks",
    "paged_decode_attention",
    "prefill_attention",
    "rms_norm",
    "rope_and_write_kv",
    "silu_and_mul",
    "silu_mul_linear",
    "unpack_kv_blocks",
    "write_kv_cache",
]
