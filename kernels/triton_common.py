"""Small helpers shared by the Triton kernel files (host side and device side)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests): kernels then avoid interpreter gaps."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (host-side query, cached: safe during graph capture).
    On CPU (interpreter) a small pretend count keeps the split logic exercised by tests."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def dot_flags(dtype: torch.dtype) -> dict:
    """Constexpr flags for `dot`: IEEE fp32 products for fp32 inputs (no TF32, so tests can be
    tight); under the interpreter bf16 operands are upcast first (its tl.dot multiplies raw
    bf16 bits). The upcast is exact, so interpreter results match GPU numerics."""
    return {"IEEE": dtype == torch.float32, "UPCAST": interpreting() and dtype == torch.bfloat16}


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def load_rows(
    ptrs, row_mask, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr
):
    """Loads a [rows, BLOCK_D] tile; masks are built only where needed (constexpr) so the
    common case (power-of-two D, interior tile) compiles to unmasked, vectorised loads."""
    if MASK_ROWS:
        if D == BLOCK_D:
            return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=row_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    else:
        if D == BLOCK_D:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
