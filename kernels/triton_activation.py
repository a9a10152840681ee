"""SiLU-and-mul for the gated MLP: [T, 2I] -> [T, I] (gate = first half, up = second half)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import pow2


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    gf = gate.to(tl.float32)
    # silu is rounded to the input dtype before the multiply, as torch's silu(gate) * up does.
    act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    two_i = x.shape[-1]
    assert two_i % 2 == 0, f"silu_and_mul needs an even last dim, got {two_i}"
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return out
    block = min(pow2(inter), 2048)
    grid = (rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x2, out.view(-1, inter), x2.stride(0), inter, inter, BLOCK=block, num_warps=4
    )
    return out
