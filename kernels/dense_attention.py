"""Causal attention of one fresh prompt as one dense SDPA call (cuDNN's fused attention on CUDA).

A prefill step of a single sequence with nothing cached before it needs no block table: its
keys are its own tokens, positions 0..T-1 in order. cuDNN's kernel outruns our varlen Triton
kernel there (H100, d=64, GQA 32/8, bf16, causal, us per layer: 1x1024 25.8 vs 47.0, 1x3072
113 vs 143, 1x8192 621 vs 810; torch's flash backend 37 / 180 / 998; .gpu probe in
benchmarks/results/h100-2026-12-08/README.md), so the piecewise prefill graphs run such steps
through here (engine/prefill_graphs.py, engine/prefill_dense.py).

The step's rows may be padded (engine/prefill_dense.py: to a few lengths per graph bucket, so
cuDNN builds a few plans at start-up instead of one per prompt length while a user waits). The
padding rows (position 0, the null slot) come after every real row, which causal masking keeps
off them; their keys come from the null block (finite), their outputs are never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# CUDA: cuDNN only (the flash and efficient backends lose to the Triton kernel, see above);
# elsewhere (CPU tests) the math backend. `sdpa_kernel` sets process-wide flags for its block:
# one thread of a worker calls this (the prefill step thread, or the decode engine thread), and
# nothing else in a worker calls SDPA.
_CUDA_BACKENDS = [SDPBackend.CUDNN_ATTENTION]
_OTHER_BACKENDS = [SDPBackend.MATH]


def dense_causal_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """q [N, Hq, D] (row i at position i of one sequence), its keys / values at cache `slots`
    [N] of k_cache / v_cache [blocks, block_size, Hkv, D] -> out [N, Hq, D]."""
    hkv, d = k_cache.shape[-2:]
    k = k_cache.view(-1, hkv, d).index_select(0, slots)
    v = v_cache.view(-1, hkv, d).index_select(0, slots)
    backends = _CUDA_BACKENDS if q.device.type == "cuda" else _OTHER_BACKENDS
    with sdpa_kernel(backends):
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0).transpose(1, 2),  # [1, Hq, N, D] views: no copies
            k.unsqueeze(0).transpose(1, 2),
            v.unsqueeze(0).transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[1] != hkv,
        )
    out.copy_(o[0].transpose(0, 1))


def dense_disagrees(
    like: torch.Tensor, num_kv_heads: int, block_size: int, scale: float, n: int
) -> str | None:
    """Checks the dense call against the varlen kernel (kernels/ops.py) on `n` random tokens of
    `like`'s shape [*, Hq, D], dtype and device, in scratch caches (the KV pool is untouched):
    None when they agree within the dtype's tolerance, else what differs. Run once at start-up,
    so that a backend computing something else on an untested GPU turns the dense path off."""
    from splitserve.kernels import ops

    g = torch.Generator(device=like.device).manual_seed(0)
    hq, d = like.shape[-2:]
    blocks = -(-n // block_size) + 1  # block 0 left out, as the null block is

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=like.device).to(like.dtype)

    q = rand(n, hq, d)
    k_cache, v_cache = (
        rand(blocks, block_size, num_kv_heads, d),
        rand(blocks, block_size, num_kv_heads, d),
    )
    slots = torch.arange(block_size, block_size + n, device=like.device)
    table = torch.arange(1, blocks, dtype=torch.int32, device=like.device)[None]
    cu = torch.tensor([0, n], dtype=torch.int32, device=like.device)
    lens = cu[1:].clone()
    want = ops.prefill_attention(q, k_cache, v_cache, table, cu, lens, n, scale)
    got = torch.empty_like(q)
    dense_causal_attention(q, k_cache, v_cache, slots, scale, got)
    err = float((got.float() - want.float()).abs().max())
    tol = 2e-2 if like.dtype in (torch.bfloat16, torch.float16) else 1e-4
    return None if err <= tol else f"max difference {err:.3g} from the varlen kernel (> {tol})"
