"""Small-M linear layers (decode, M <= 4 tokens) as GEMV kernels with a fused input prologue.

    fused_add_rms_norm_linear  out = rms_norm(x + residual) @ W.T + b, and x + residual
    silu_mul_linear            out = (silu(gate) * up) @ W.T + b      (gate_up = [gate | up])
    linear_small_m             out = x @ W.T + b

The kernel (triton_fused_linear_kernel.py, with its design and rounding rules) streams the
weight once per call: program p owns BLOCK_N output features for all M tokens and rebuilds the
input tile it needs (residual add + RMSNorm, or SiLU-and-mul) on the fly. This module holds the
Python side: operand checks, the launch, and the choice of config.

Tuning: `CONFIGS` (per padded M) with `PROGRAMS_PER_SM` / `MIN_BLOCK_N`, and exact-shape
overrides in `TUNED`; `benchmarks/kernels_linear.py` times variants through the
`config=` argument of the `*_impl` functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from splitserve.kernels.triton_common import interpreting, pow2, sm_count
from splitserve.kernels.triton_fused_linear_kernel import NORM, PLAIN, SILU, small_m_linear_kernel


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
# (no BLOCK_N shrinking). Filled from `benchmarks/kernels_linear.py` on the target GPU.
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
    small_m_linear_kernel[(triton.cdiv(n, cfg.block_n),)](
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
