"""Small-M linear layers (decode, M <= 4 tokens) as GEMV kernels with a fused input prologue.

    fused_add_rms_norm_linear  out = rms_norm(x + residual) @ W.T + b, and x + residual
    silu_mul_linear            out = (silu(gate) * up) @ W.T + b      (gate_up = [gate | up])
    linear_small_m             out = x @ W.T + b

At batch 1..4 a linear layer is one pass over its weight, so the kernel is a weight stream:
program p owns BLOCK_N output features (weight rows) for all M tokens and walks K in
[BLOCK_N, BLOCK_K] tiles, contiguous along K, one 16-byte load per thread and row. The M input
rows are tiny (4 KB for K = 2048) and stay in L2, so every program rebuilds the input tile it
needs on the fly: the residual add + RMSNorm (the row's RMS comes from a first pass over it, or
from the tile itself when K fits one tile; every program computes it, there is no cross-program
communication) or the SiLU-and-mul. Each thread sums its products in registers (fp32, BLOCK_M x
BLOCK_N partial sums); the lanes and warps that split K are reduced once, after the loop. No
split-K: BLOCK_N shrinks instead until the grid covers every SM `PROGRAMS_PER_SM` times. The
input tile re-reads cost L2 traffic of about (4 * M + 1) / BLOCK_N times the weight bytes (norm
with residual, two passes): fine at M = 1, the reason BLOCK_N should not shrink much at M = 4.

Rounding follows the torch reference step for step (reference.py): the residual sum is rounded
to the input dtype, the normalised row is rounded before the norm-weight multiply and again
after it, silu(gate) is rounded before the multiply by up and the product again; only then does
the fp32 dot product start. Program 0 alone writes the new residual, into its own buffer (the
other programs are still reading x and residual).

Tuning: `CONFIGS` (per padded M) with `PROGRAMS_PER_SM` / `MIN_BLOCK_N`, and exact-shape
overrides in `TUNED`; `benchmarks/kernels.py --sweep-linear` times variants through the
`config=` argument of the `*_impl` functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import interpreting, pow2, sm_count

PLAIN, NORM, SILU = 0, 1, 2  # input prologue modes


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows (output features) per program; shrunk for narrow N (see pick_config)
    num_warps: int = 4
    num_stages: int = 1  # > 1: software-pipelined weight loads (cp.async through shared memory)
    # K elements per loop step; 0: one 16-byte vector per thread and row (16 / element size * 32 *
    # num_warps), the size at which the input tile and the weight tile share one register layout
    # (any other size makes the compiler shuffle the weight tile through shared memory).
    block_k: int = 0


# Per BLOCK_M (M padded to 1, 2, 4). Registers per thread grow with BLOCK_M * BLOCK_N (the
# accumulator) + BLOCK_N * 4 (the weight vectors): the defaults compile to 56-80 registers for
# sm_90 (bf16), so many programs stay resident per SM. With 8 warps (bf16 BLOCK_K 2048) a K = 2048
# row is one tile and the norm variant reads its input rows once instead of twice, but twice the
# registers per program halve the programs resident per SM.
CONFIGS: dict[int, GemvConfig] = {
    1: GemvConfig(block_n=8, num_warps=4),
    2: GemvConfig(block_n=8, num_warps=4),
    4: GemvConfig(block_n=4, num_warps=4),
}
PROGRAMS_PER_SM = 2  # BLOCK_N halves (down to MIN_BLOCK_N) until cdiv(N, BLOCK_N) >= this * SMs
MIN_BLOCK_N = 2
# Exact-shape overrides, (mode, padded M, N, K) -> config, mode in MODE_NAMES; taken as they are
# (no BLOCK_N shrinking). Filled from `benchmarks/kernels.py --sweep-linear` on the target GPU.
# Best of `benchmarks/kernels.py --only small_m_linear --sweep-linear --linear-m 1` on the H200
# (llama-3.2-1b shapes), µs: qkv 11.4 -> 10.0, gate_up 28.6 -> 27.2, down 18.6 -> 16.3,
# o_proj 8.6 -> 8.2, lm_head 130.5 -> 128.5.
TUNED: dict[tuple[str, int, int, int], GemvConfig] = {
    ("norm", 1, 3072, 2048): GemvConfig(block_n=8, num_warps=4, num_stages=1, block_k=2048),
    ("norm", 1, 16384, 2048): GemvConfig(block_n=4, num_warps=4, num_stages=1, block_k=2048),
    ("silu", 1, 2048, 8192): GemvConfig(block_n=4, num_warps=8, num_stages=1, block_k=4096),
    ("plain", 1, 2048, 2048): GemvConfig(block_n=2, num_warps=8, num_stages=1, block_k=0),
    ("norm", 1, 128256, 2048): GemvConfig(block_n=4, num_warps=4, num_stages=1, block_k=2048),
}
MODE_NAMES = ("plain", "norm", "silu")


def pick_config(m: int, n: int, k: int, device: torch.device, mode: int = NORM) -> GemvConfig:
    tuned = TUNED.get((MODE_NAMES[mode], pow2(m), n, k))
    if tuned is not None:
        return tuned
    cfg = CONFIGS[pow2(m)]
    block_n = cfg.block_n
    while block_n > MIN_BLOCK_N and triton.cdiv(n, block_n) < PROGRAMS_PER_SM * sm_count(device):
        block_n //= 2
    return GemvConfig(block_n, cfg.num_warps, cfg.num_stages, cfg.block_k)


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
def _small_m_linear_kernel(
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


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(mode, x2, r2, nw, weight, bias, out2, sum2, eps, k, config: GemvConfig | None):
    m, n = out2.shape
    if m == 0 or n == 0:
        return
    assert weight.shape[1] == k, f"weight {tuple(weight.shape)} does not match the input width {k}"
    cfg = config or pick_config(m, n, k, x2.device, mode)
    vec = 16 // x2.element_size()  # one 16-byte load per thread and row
    block_k = cfg.block_k or vec * 32 * cfg.num_warps
    assert block_k == pow2(block_k), f"BLOCK_K must be a power of two, got {block_k}"
    block_k = min(block_k, max(pow2(k), vec))
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    dummy = w  # never dereferenced when the matching constexpr flag is off
    _small_m_linear_kernel[(triton.cdiv(n, cfg.block_n),)](
        x2,
        r2 if r2 is not None else x2,
        nw if nw is not None else dummy,
        w,
        bias.contiguous() if bias is not None else dummy,
        out2,
        sum2 if sum2 is not None else out2,
        m,
        n,
        k,
        x2.stride(0),
        r2.stride(0) if r2 is not None else 0,
        w.stride(0),
        out2.stride(0),
        sum2.stride(0) if sum2 is not None else 0,
        float(eps),
        MODE=mode,
        ADD=r2 is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=pow2(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        VEC=min(vec, block_k),
        MASK_K=k % block_k != 0,
        ONE_TILE=k <= block_k,
        NUM_STAGES=cfg.num_stages,
        RTNE=interpreting() and x2.dtype == torch.bfloat16,
        num_warps=cfg.num_warps,
    )


def _check_dtypes(*tensors) -> None:
    dtypes = {t.dtype for t in tensors if t is not None}
    assert len(dtypes) == 1, (
        f"the small-M linear kernels need one dtype for all operands, got {dtypes}"
    )


def fused_add_rms_norm_linear_impl(x, residual, norm_weight, eps, weight, bias=None, config=None):
    _check_dtypes(x, residual, norm_weight, weight, bias)
    k = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    r2 = summed = None
    if residual is not None:
        r2 = _rows(residual)
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(
        NORM,
        x2,
        r2,
        norm_weight.contiguous(),
        weight,
        bias,
        out.view(-1, weight.shape[0]),
        None if summed is None else summed.view(-1, k),
        eps,
        k,
        config,
    )
    return out, (x if summed is None else summed)


def fused_add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias=None):
    return fused_add_rms_norm_linear_impl(x, residual, norm_weight, eps, weight, bias)


def silu_mul_linear_impl(gate_up, weight, bias=None, config=None):
    _check_dtypes(gate_up, weight, bias)
    two_i = gate_up.shape[-1]
    assert two_i % 2 == 0, f"silu_mul_linear needs an even last dim, got {two_i}"
    out = torch.empty(
        *gate_up.shape[:-1], weight.shape[0], dtype=gate_up.dtype, device=gate_up.device
    )
    _launch(
        SILU,
        _rows(gate_up),
        None,
        None,
        weight,
        bias,
        out.view(-1, weight.shape[0]),
        None,
        0.0,
        two_i // 2,
        config,
    )
    return out


def silu_mul_linear(gate_up, weight, bias=None):
    return silu_mul_linear_impl(gate_up, weight, bias)


def linear_small_m_impl(x, weight, bias=None, config=None):
    _check_dtypes(x, weight, bias)
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(
        PLAIN,
        _rows(x),
        None,
        None,
        weight,
        bias,
        out.view(-1, weight.shape[0]),
        None,
        0.0,
        x.shape[-1],
        config,
    )
    return out


def linear_small_m(x, weight, bias=None):
    return linear_small_m_impl(x, weight, bias)
