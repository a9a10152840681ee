"""Input builders shared by the CPU (interpreter) and GPU kernel tests."""

from __future__ import annotations

import os

import pytest
import torch

# CPU cases need the interpreter; on a CUDA machine they skip (the gpu cases cover it there).
cpu_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="CPU Triton tests need TRITON_INTERPRET=1 (set by tests/kernels/conftest.py without CUDA)",
)

# assert_close tolerances. fp32: same math up to summation order. bf16: an output may be one
# or two ulps off (2^-7 relative each): the interpreter truncates fp32 -> bf16 where the GPU
# rounds to nearest, and attention rounds its probabilities to bf16 before P @ V.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, device="cpu", g=None) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def cos_sin_cache(max_pos: int, rot: int, base: float = 10000.0, device="cpu") -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


def paged_kv(ctx_lens, hkv, d, bs, dtype, device="cpu", seed=0, extra_cols=1, poison=True):
    """A KV pool holding each sequence's context in shuffled blocks (never block 0, the null
    block). With `poison`, every slot that is not part of some context is NaN, so a kernel that
    reads past a context (or multiplies a masked value by 0) shows up as NaN in its output."""
    g = gen(seed)
    nblk = [(n + bs - 1) // bs for n in ctx_lens]
    total = sum(nblk)
    num_blocks = total + 3
    k_cache = randn(num_blocks, bs, hkv, d, dtype=dtype, g=g)
    v_cache = randn(num_blocks, bs, hkv, d, dtype=dtype, g=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1)[:total]
    max_blocks = max(nblk + [1]) + extra_cols
    tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
    valid = torch.zeros(num_blocks * bs, dtype=torch.bool)
    pos = 0
    for b, (n, nb) in enumerate(zip(ctx_lens, nblk)):
        ids = perm[pos : pos + nb]
        pos += nb
        tables[b, :nb] = ids.to(torch.int32)
        tok = torch.arange(n)
        valid[ids[tok // bs] * bs + tok % bs] = True
    if poison:
        for c in (k_cache, v_cache):
            c.view(-1, hkv, d)[~valid] = float("nan")
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    return k_cache.to(device), v_cache.to(device), tables.to(device), lens.to(device)


def prefill_inputs(q_lens, ctx_lens, hq, hkv, d, bs, dtype, device="cpu", seed=0):
    k_cache, v_cache, tables, lens = paged_kv(ctx_lens, hkv, d, bs, dtype, device, seed)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = randn(int(cu[-1]), hq, d, dtype=dtype, device=device, g=gen(seed + 1))
    return q, k_cache, v_cache, tables, cu.to(device), lens
