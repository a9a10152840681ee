"""Norms, activation, RoPE, KV-cache writes and KV block packing: Triton vs torch reference
(CPU, Triton interpreter). Odd sizes everywhere: non-power-of-two widths, head counts and
rotary widths, one-token inputs, partial rotary."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import TOL, cos_sin_cache, cpu_interpreter, gen, randn

from splitserve.kernels import ops, reference
from splitserve.kernels.dispatch import force_triton

pytestmark = cpu_interpreter
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOL[expected.dtype])


def test_interpreter_is_active():
    """The kernels really run in the interpreter on CPU tensors (the env var took effect)."""
    from triton.runtime.interpreter import InterpretedFunction

    from splitserve.kernels import triton_norm

    assert isinstance(triton_norm._rms_norm_kernel, InterpretedFunction)
    x = torch.ones(2, 3)
    with force_triton():
        y = ops.rms_norm(x, torch.full((3,), 2.0), 1e-6)
    torch.testing.assert_close(y, torch.full((2, 3), 2.0), atol=1e-6, rtol=0)


def test_reference_is_used_without_force():
    x = torch.randn(2, 8)
    w = torch.randn(8)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (5, 96), (2, 3, 200)])
def test_rms_norm(dtype, shape):
    g = gen(1)
    x = randn(*shape, dtype=dtype, g=g) * 3
    w = randn(shape[-1], dtype=dtype, g=g)
    with force_triton():
        out = ops.rms_norm(x, w, 1e-6)
    close(out, reference.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 40), (7, 136)])
def test_fused_add_rms_norm(dtype, shape):
    g = gen(2)
    x, res = randn(*shape, dtype=dtype, g=g), randn(*shape, dtype=dtype, g=g)
    w = randn(shape[-1], dtype=dtype, g=g)
    x0, res0 = x.clone(), res.clone()
    with force_triton():
        out, summed = ops.fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_sum = reference.fused_add_rms_norm(x, res, w, 1e-5)
    close(out, ref_out)
    close(summed, ref_sum)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched, like the reference


def test_rms_norm_strided_rows():
    """A row-strided view (e.g. a slice of a wider activation) is read in place."""
    g = gen(3)
    base = randn(6, 100, g=g)
    x = base[:, :64]
    w = randn(64, g=g)
    with force_triton():
        out = ops.rms_norm(x, w, 1e-6)
    close(out, reference.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 80), (2, 3, 2 * 2100)])
def test_silu_and_mul(dtype, shape):
    x = randn(*shape, dtype=dtype, g=gen(4)) * 2
    with force_triton():
        out = ops.silu_and_mul(x)
    close(out, reference.silu_and_mul(x))


# (num_tokens, q heads, kv heads, head_dim, rotary width)
ROPE_CASES = [
    (1, 4, 4, 16, 16),
    (5, 8, 2, 32, 32),
    (7, 8, 1, 64, 16),  # partial rotary, GQA 8
    (3, 6, 3, 32, 24),  # non-power-of-two heads and rotary half (12)
    (2, 2, 2, 256, 256),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ROPE_CASES, ids=str)
def test_apply_rope(dtype, case):
    t, hq, hkv, d, rot = case
    g = gen(5)
    q, k = randn(t, hq, d, dtype=dtype, g=g), randn(t, hkv, d, dtype=dtype, g=g)
    pos = torch.randint(0, 100, (t,), generator=g)
    cs = cos_sin_cache(128, rot)
    with force_triton():
        q_out, k_out = ops.apply_rope(q, k, pos, cs)
    q_ref, k_ref = reference.apply_rope(q, k, pos, cs)
    close(q_out, q_ref)
    close(k_out, k_ref)
    if rot < d:
        assert torch.equal(q_out[..., rot:], q[..., rot:])


def test_apply_rope_strided_qk():
    """q and k as column slices of one fused qkv projection output."""
    t, hq, hkv, d = 5, 4, 2, 32
    qkv = randn(t, (hq + 2 * hkv) * d, g=gen(6))
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    pos = torch.arange(t) * 3
    cs = cos_sin_cache(32, d)
    with force_triton():
        q_out, k_out = ops.apply_rope(q, k, pos, cs)
    q_ref, k_ref = reference.apply_rope(q, k, pos, cs)
    close(q_out, q_ref)
    close(k_out, k_ref)


def _caches(nb, bs, hkv, d, dtype):
    k_cache = randn(nb, bs, hkv, d, dtype=dtype, g=gen(7))
    v_cache = randn(nb, bs, hkv, d, dtype=dtype, g=gen(8))
    return k_cache, v_cache


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("t,hkv,d,bs", [(1, 1, 16, 4), (7, 3, 32, 4), (20, 2, 64, 16)])
def test_write_kv_cache(dtype, cache_dtype, t, hkv, d, bs):
    g = gen(9)
    k, v = randn(t, hkv, d, dtype=dtype, g=g), randn(t, hkv, d, dtype=dtype, g=g)
    nb = (t + bs - 1) // bs + 2
    slots = torch.randperm(nb * bs, generator=g)[:t]
    k_cache, v_cache = _caches(nb, bs, hkv, d, cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    with force_triton():
        ops.write_kv_cache(k, v, k_cache, v_cache, slots)
    reference.write_kv_cache(k, v, k_ref, v_ref, slots)
    if dtype == cache_dtype:
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    else:  # conversion: the interpreter truncates fp32 -> bf16 (the GPU rounds): one ulp
        torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=8e-3)
        torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ROPE_CASES[:4], ids=str)
def test_rope_and_write_kv(dtype, case):
    t, hq, hkv, d, rot = case
    bs = 4
    g = gen(10)
    q, k, v = (randn(t, h, d, dtype=dtype, g=g) for h in (hq, hkv, hkv))
    pos = torch.randint(0, 60, (t,), generator=g)
    cs = cos_sin_cache(64, rot)
    nb = (t + bs - 1) // bs + 2
    slots = torch.randperm(nb * bs, generator=g)[:t]
    k_cache, v_cache = _caches(nb, bs, hkv, d, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    with force_triton():
        q_out = ops.rope_and_write_kv(q, k, v, pos, cs, k_cache, v_cache, slots)
    q_ref = reference.rope_and_write_kv(q, k, v, pos, cs, k_ref, v_ref, slots)
    close(q_out, q_ref)
    close(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_kv_write_into_layer_view_of_fused_pool():
    """k_cache = kv_cache[l, 0] (a strided view into the one pool tensor) is written in place."""
    layers, nb, bs, hkv, d = 3, 5, 4, 2, 16
    pool = torch.zeros(layers, 2, nb, bs, hkv, d)
    ref_pool = pool.clone()
    g = gen(11)
    k, v = randn(6, hkv, d, g=g), randn(6, hkv, d, g=g)
    slots = torch.tensor([4, 5, 6, 19, 0, 12])
    with force_triton():
        ops.write_kv_cache(k, v, pool[1, 0], pool[1, 1], slots)
    reference.write_kv_cache(k, v, ref_pool[1, 0], ref_pool[1, 1], slots)
    assert torch.equal(pool, ref_pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("geom", [(2, 9, 4, 3, 16), (1, 4, 16, 2, 64)], ids=str)
def test_pack_unpack_kv_blocks(dtype, geom):
    layers, nb, bs, hkv, d = geom
    kv = randn(layers, 2, nb, bs, hkv, d, dtype=dtype, g=gen(12))
    ids = torch.tensor([nb - 1, 1, 2][: nb - 1] if nb > 3 else [1])
    with force_triton():
        packed = ops.pack_kv_blocks(kv, ids)
        out = torch.full_like(packed, float("nan"))
        returned = ops.pack_kv_blocks(kv, ids, out)
    expected = reference.pack_kv_blocks(kv, ids)
    assert packed.is_contiguous() and torch.equal(packed, expected)
    assert returned is out and torch.equal(out, expected)

    target, target_ref = torch.zeros_like(kv), torch.zeros_like(kv)
    with force_triton():
        ops.unpack_kv_blocks(packed, target, ids)
    reference.unpack_kv_blocks(packed, target_ref, ids)
    assert torch.equal(target, target_ref)


def test_unpack_converts_dtype():
    kv = torch.zeros(2, 2, 6, 4, 2, 16, dtype=torch.bfloat16)
    packed = randn(2, 2, 3, 4, 2, 16, g=gen(13))
    ids = torch.tensor([5, 0, 3], dtype=torch.int32)
    ref_kv = kv.clone()
    with force_triton():
        ops.unpack_kv_blocks(packed, kv, ids)
    reference.unpack_kv_blocks(packed, ref_kv, ids)
    # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): allow one ulp
    torch.testing.assert_close(kv, ref_kv, atol=0, rtol=8e-3)
