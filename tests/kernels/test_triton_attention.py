"""Paged decode and prefill attention: Triton vs torch reference (CPU, Triton interpreter).

The KV pools are poisoned with NaN everywhere outside the live contexts (null block, tail of
the last block, unused blocks), so a kernel that reads past a context fails loudly."""

from __future__ import annotations

import contextlib

import pytest
import torch
from kernel_inputs import TOL, cpu_interpreter, gen, paged_kv, prefill_inputs, randn

from splitserve.kernels import ops, reference
from splitserve.kernels.dispatch import force_triton

pytestmark = cpu_interpreter

# (q heads, kv heads, head_dim, block_size, context_lens)
DECODE_CASES = [
    (4, 4, 16, 4, [1, 7, 0, 33]),  # GQA 1, one-token context, padded lane
    (8, 2, 32, 4, [37, 0, 16, 5]),  # GQA 4
    (8, 1, 64, 16, [70, 1, 0]),  # GQA 8, several blocks
    (16, 1, 16, 16, [40]),  # GQA 16
    (6, 3, 32, 8, [0, 0]),  # every lane padded
]


def _close(out, expected):
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOL[expected.dtype])


def _decode_check(case, dtype, num_splits=None, block_n=None, seed=0):
    from splitserve.kernels.triton_decode_attention import paged_decode_attention_impl

    hq, hkv, d, bs, lens = case
    k_cache, v_cache, tables, ctx = paged_kv(lens, hkv, d, bs, dtype, seed=seed)
    q = randn(len(lens), hq, d, dtype=dtype, g=gen(seed + 1))
    scale = d**-0.5
    with force_triton():
        if num_splits is None and block_n is None:
            out = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
        else:
            out = paged_decode_attention_impl(
                q, k_cache, v_cache, tables, ctx, scale, num_splits, block_n
            )
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    _close(out, expected)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_fp32(case, num_splits):
    _decode_check(case, torch.float32, num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", DECODE_CASES[1:3], ids=str)
def test_decode_half(case, dtype):
    _decode_check(case, dtype, num_splits=2)


def test_decode_strided_q():
    """q as a column slice of a fused qkv activation (row stride > Hq * D)."""
    hq, hkv, d = 8, 2, 32
    k_cache, v_cache, tables, ctx = paged_kv([19, 0, 40], hkv, d, 4, torch.float32)
    qkv = randn(3, (hq + 2 * hkv) * d, g=gen(4))
    q = qkv[:, : hq * d].view(3, hq, d)
    with force_triton():
        out = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.3)
    _close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.3))


@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_decode_head_dims(d):
    _decode_check((4, 2, d, 16, [21, 0, 50]), torch.float32, num_splits=2)


def test_decode_tile_smaller_than_block():
    """BLOCK_N < block_size: one cache block spans several tiles."""
    _decode_check((8, 2, 32, 16, [45, 3]), torch.float32, num_splits=2, block_n=16)
    _decode_check((8, 2, 32, 64, [150, 3]), torch.float32, num_splits=1, block_n=16)


def test_decode_plan_depends_only_on_shapes():
    from splitserve.kernels.triton_decode_attention import plan_splits

    cpu = torch.device("cpu")
    assert plan_splits(batch=1, hkv=2, max_ctx=4096, block_n=16, device=cpu) > 1
    assert (
        plan_splits(batch=1, hkv=2, max_ctx=16, block_n=16, device=cpu) == 1
    )  # one tile: no split
    assert (
        plan_splits(batch=64, hkv=8, max_ctx=4096, block_n=16, device=cpu) == 1
    )  # lanes fill the machine


def test_decode_more_splits_than_tiles():
    """Splits beyond the live context's tile count exit early; the reduce ignores them."""
    _decode_check((8, 2, 32, 4, [37, 0, 1, 16]), torch.float32, num_splits=7)
    _decode_check((4, 1, 16, 16, [200]), torch.float32, num_splits=64)


_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__")


def test_decode_no_host_sync(monkeypatch):
    """The decode launcher never reads a tensor value on the host (CUDA-graph safety): host
    reads raise while the launcher runs; they are allowed again only inside a kernel launch
    (the interpreter itself reads tensors)."""
    import splitserve.kernels.triton_decode_attention as mod

    k_cache, v_cache, tables, ctx = paged_kv([9, 0, 30], 2, 16, 4, torch.float32)
    q = randn(3, 4, 16, g=gen(2))
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25)
    real = {m: getattr(torch.Tensor, m) for m in _HOST_READS}

    def boom(*_a, **_k):
        raise AssertionError("host read of a tensor value in the decode launcher")

    def guard(on: bool) -> None:
        for m, f in real.items():
            setattr(torch.Tensor, m, boom if on else f)

    grids = []

    class Launch:  # kernel[grid](...) with the guard lifted while the kernel itself runs
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            grids.append((self.name, grid))

            def run(*args, **kwargs):
                guard(False)
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    guard(True)

            return run

    for name in ("_decode_partial_kernel", "_decode_reduce_kernel"):
        monkeypatch.setattr(mod, name, Launch(getattr(mod, name), name))
    guard(True)
    try:
        with force_triton():
            out = mod.paged_decode_attention_impl(
                q, k_cache, v_cache, tables, ctx, 0.25, num_splits=2
            )
    finally:
        guard(False)
    # (batch, kv heads, splits) and (batch, q heads): from shapes only
    assert grids == [("_decode_partial_kernel", (3, 2, 2)), ("_decode_reduce_kernel", (3, 4))]
    _close(out, expected)


# (q heads, kv heads, head_dim, block_size, q_lens, context_lens)
PREFILL_CASES = [
    (4, 4, 16, 4, [5], [5]),
    (8, 2, 32, 4, [5, 0, 1, 17], [5, 3, 9, 40]),  # empty query, one token, cached prefixes
    (8, 1, 64, 16, [33, 2], [33, 50]),  # GQA 8, chunked prefill
    (16, 1, 16, 8, [19], [19]),  # GQA 16
]


def _prefill_check(case, dtype, block_m=None, block_n=None, seed=0):
    from splitserve.kernels.triton_prefill_attention import prefill_attention_impl

    hq, hkv, d, bs, q_lens, lens = case
    q, k_cache, v_cache, tables, cu, ctx = prefill_inputs(
        q_lens, lens, hq, hkv, d, bs, dtype, seed=seed
    )
    scale = d**-0.5
    max_q = max(q_lens)
    with force_triton():
        if block_m is None:
            out = ops.prefill_attention(q, k_cache, v_cache, tables, cu, ctx, max_q, scale)
        else:
            out = prefill_attention_impl(
                q, k_cache, v_cache, tables, cu, ctx, max_q, scale, block_m, block_n
            )
    expected = reference.prefill_attention(q, k_cache, v_cache, tables, cu, ctx, max_q, scale)
    _close(out, expected)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
@pytest.mark.parametrize("tiles", [None, (32, 16), (16, 32)], ids=str)
def test_prefill_fp32(case, tiles):
    _prefill_check(case, torch.float32, *(tiles or (None, None)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", PREFILL_CASES[1:3], ids=str)
def test_prefill_half(case, dtype):
    _prefill_check(case, dtype)


@pytest.mark.parametrize("d", [32, 128, 256])
def test_prefill_head_dims(d):
    _prefill_check((4, 2, d, 16, [9, 3], [20, 3]), torch.float32)


def test_prefill_one_token_matches_decode():
    """A one-token prefill over a cached prefix is a decode step: both kernels agree."""
    hq, hkv, d, bs, lens = 8, 2, 32, 4, [13, 29]
    k_cache, v_cache, tables, ctx = paged_kv(lens, hkv, d, bs, torch.float32)
    q = randn(2, hq, d, g=gen(5))
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with force_triton():
        pre = ops.prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 1, 0.2)
        dec = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2)
    torch.testing.assert_close(pre, dec, atol=1e-6, rtol=1e-6)


def test_prefill_writes_into_a_given_out_and_leaves_other_rows():
    """The piecewise prefill graphs pass their static buffer's first T rows as `out`."""
    hq, hkv, d, bs, q_lens, lens = PREFILL_CASES[0]
    q, k_cache, v_cache, tables, cu, ctx = prefill_inputs(
        q_lens, lens, hq, hkv, d, bs, torch.float32, seed=3
    )
    t = q.shape[0]
    expected = reference.prefill_attention(q, k_cache, v_cache, tables, cu, ctx, max(q_lens), 0.3)
    for use in (contextlib.nullcontext, force_triton):
        buf = torch.full((t + 5, hq, d), 7.0)
        with use():
            got = ops.prefill_attention(
                q, k_cache, v_cache, tables, cu, ctx, max(q_lens), 0.3, out=buf[:t]
            )
        assert got.data_ptr() == buf.data_ptr()
        _close(buf[:t], expected)
        assert bool((buf[t:] == 7.0).all())
