"""The small-M GEMV kernel behind triton_fused_linear.py (its launchers, configs and tuning).

`small_m_linear_kernel` computes out = prologue(x) @ W.T + b for M <= 4 rows, the prologue
chosen by MODE: PLAIN (x), NORM (rms_norm(x + residual) * norm_weight; with ADD the sum is
written too) or SILU (silu(gate) * up, gate_up = [gate | up]).

At batch 1..4 a linear layer is one pass over its weight, so the kernel is a weight stream:
program p owns BLOCK_N output features (weight rows) for all M tokens and walks K in
[BLOCK_N, BLOCK_K] tiles, contiguous along K, one 16-byte load per thread and row. The M input
rows are tiny (4 KB for K = 2048) and stay in L2, so every program rebuilds the input tile it
needs on the fly: the residual add + RMSNorm (the row's RMS comes from a first pass over it, or
from the tile itself when K fits one tile; every program computes it, there is no cross-program
communication) or the SiLU-and-mul. Each thread sums its products in registers (fp32, BLOCK_M x
BLOCK_N partial sums); the lanes and warps that split K are reduced once, after the loop. No
split-K: the launcher's pick_config shrinks BLOCK_N instead until the grid covers every SM
`PROGRAMS_PER_SM` times. The input tile re-reads cost L2 traffic of about (4 * M + 1) / BLOCK_N
times the weight bytes (norm with residual, two passes): fine at M = 1, the reason BLOCK_N
should not shrink much at M = 4.

Rounding follows the torch reference step for step (reference.py): the residual sum is rounded
to the input dtype, the normalised row is rounded before the norm-weight multiply and again
after it, silu(gate) is rounded before the multiply by up and the product again; only then does
the fp32 dot product start. Program 0 alone writes the new residual, into its own buffer (the
other programs are still reading x and residual).
"""

from __future__ import annotations

import triton
import triton.language as tl

PLAIN, NORM, SILU = 0, 1, 2  # input prologue modes (the kernel's MODE)


@triton.jit
def _round(x, dtype: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """fp32 `x` rounded to nearest-even in `dtype` (returned as `dtype`). The interpreter's
    fp32 -> bf16 cast truncates, so there (EMULATE_RTNE) the rounding is done on the bits first."""
    if EMULATE_RTNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + ((bits >> 16) & 1) + 0x7FFF) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _load_sum(x_ptrs, r_ptrs, mask, ADD: tl.constexpr, MASK_K: tl.constexpr, RTNE: tl.constexpr):
    """x (+ residual, rounded to x's dtype) at the given pointers."""
    if MASK_K:
        x = tl.load(x_ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(x_ptrs)
    if ADD:
        if MASK_K:
            r = tl.load(r_ptrs, mask=mask, other=0.0)
        else:
            r = tl.load(r_ptrs)
        x = _round(x.to(tl.float32) + r.to(tl.float32), x.dtype, RTNE)
    return x


@triton.jit
def small_m_linear_kernel(
    x_ptr,
    r_ptr,
    nw_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    sum_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_om,
    stride_sm,
    eps,
    MODE: tl.constexpr,
    ADD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    MASK_K: tl.constexpr,
    ONE_TILE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    RTNE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Padding rows/features re-read the last real one (unmasked, vectorised loads); stores mask them.
    rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    feats = tl.minimum(offs_n, N - 1).to(tl.int64)
    m_mask3 = offs_m[:, None, None] < M

    if (
        MODE == 1 and not ONE_TILE
    ):  # pass 1: RMS of each (x + residual) row; program 0 writes the sum
        ss = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk[None, :] < K
            s = _load_sum(
                x_ptr + rows[:, None] * stride_xm + kk[None, :],
                r_ptr + rows[:, None] * stride_rm + kk[None, :],
                k_mask,
                ADD,
                MASK_K,
                RTNE,
            )
            sf = s.to(tl.float32)
            ss += sf * sf
            if ADD:
                if pid == 0:
                    tl.store(
                        sum_ptr + offs_m[:, None] * stride_sm + kk[None, :],
                        s,
                        mask=(offs_m[:, None] < M) & k_mask,
                    )
        rstd = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)[:, None, None]  # [BLOCK_M, 1, 1]

    rows3 = rows[:, None, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // VEC], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k[None, None, :]  # [1, 1, BLOCK_K]
        k_mask = kk < K
        w_ptrs = w_ptr + feats[None, :, None] * stride_wn + kk  # [1, BLOCK_N, BLOCK_K]
        if MASK_K:
            w = tl.load(w_ptrs, mask=k_mask, other=0.0)
        else:
            w = tl.load(w_ptrs)
        x_ptrs = x_ptr + rows3 * stride_xm + kk  # [BLOCK_M, 1, BLOCK_K]
        if MODE == 1:
            s = _load_sum(x_ptrs, r_ptr + rows3 * stride_rm + kk, k_mask, ADD, MASK_K, RTNE)
            if ONE_TILE:  # the whole row is this tile: its RMS needs no separate pass
                sf = s.to(tl.float32)
                rstd = tl.rsqrt(tl.sum(sf * sf, axis=2)[:, :, None] / K + eps)
                if ADD:
                    if pid == 0:
                        tl.store(
                            sum_ptr + offs_m[:, None, None] * stride_sm + kk,
                            s,
                            mask=m_mask3 & k_mask,
                        )
            if MASK_K:
                nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0)
            else:
                nw = tl.load(nw_ptr + kk)
            y = _round(s.to(tl.float32) * rstd, s.dtype, RTNE).to(tl.float32)
            a = _round(y * nw.to(tl.float32), w.dtype, RTNE).to(tl.float32)
        elif MODE == 2:  # gate = x[:, :K], up = x[:, K:2K]
            if MASK_K:
                g = tl.load(x_ptrs, mask=k_mask, other=0.0)
                u = tl.load(x_ptrs + K, mask=k_mask, other=0.0)
            else:
                g = tl.load(x_ptrs)
                u = tl.load(x_ptrs + K)
            gf = g.to(tl.float32)
            act = _round(gf / (1.0 + tl.exp(-gf)), g.dtype, RTNE).to(tl.float32)
            a = _round(act * u.to(tl.float32), g.dtype, RTNE).to(tl.float32)
        else:
            if MASK_K:
                a = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            else:
                a = tl.load(x_ptrs).to(tl.float32)
        # Each thread holds VEC contiguous K elements of a row: sum them in-thread (no shuffles),
        # so the accumulator is BLOCK_M * BLOCK_N registers per thread whatever BLOCK_K is.
        acc += tl.sum(
            tl.reshape(a * w.to(tl.float32), [BLOCK_M, BLOCK_N, BLOCK_K // VEC, VEC]), axis=3
        )

    out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        out += tl.load(b_ptr + feats).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        _round(out, out_ptr.dtype.element_ty, RTNE),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )
