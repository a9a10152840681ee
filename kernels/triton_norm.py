"""RMSNorm and fused residual-add + RMSNorm: one program per row, fp32 math.

Rounding follows the torch reference (and HF): the normalised row is rounded to the input
dtype before the weight multiply, and the residual sum is rounded to its own dtype before it
is normalised, so results match the reference bit for bit in practice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    H,
    eps,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] as a 2-D [rows, H] view with a unit last stride (copies only if it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x2, r2, weight, out2, sum2, eps, add):
    n, h = x2.shape
    if n == 0:
        return
    block = pow2(h)
    num_warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    _rms_norm_kernel[(n,)](
        x2,
        r2,
        weight,
        out2,
        sum2,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        sum2.stride(0),
        h,
        float(eps),
        BLOCK=block,
        ADD=add,
        num_warps=num_warps,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out2 = out.view(-1, x.shape[-1])
    _launch(x2, x2, weight.contiguous(), out2, out2, eps, add=False)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    summed = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(sum_dtype, weight.dtype), device=x.device)
    h = x.shape[-1]
    _launch(
        _rows(x),
        _rows(residual),
        weight.contiguous(),
        out.view(-1, h),
        summed.view(-1, h),
        eps,
        add=True,
    )
    return out, summed
