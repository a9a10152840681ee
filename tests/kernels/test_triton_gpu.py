"""The same checks on CUDA with realistic shapes (Llama-3.2-1B geometry, bf16), plus CUDA-graph
capture of decode attention. Run with `pytest -m gpu tests/kernels` on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import TOL, cos_sin_cache, gen, paged_kv, prefill_inputs, randn

from splitserve.kernels import ops, reference

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
# On the GPU bf16 conversions round to nearest like torch: elementwise ops agree to one ulp.
ELEMENTWISE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), BF16: dict(atol=1e-3, rtol=8e-3)}


def close(actual, expected, tol=None):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, **(tol or TOL[expected.dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("shape", [(1, 2048), (257, 2048), (33, 3000)])
def test_norms(dtype, shape):
    g = gen(1)
    x, res = (
        randn(*shape, dtype=dtype, device=DEV, g=g),
        randn(*shape, dtype=dtype, device=DEV, g=g),
    )
    w = randn(shape[-1], dtype=dtype, device=DEV, g=g)
    close(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), ELEMENTWISE_TOL[dtype])
    for a, b in zip(
        ops.fused_add_rms_norm(x, res, w, 1e-5), reference.fused_add_rms_norm(x, res, w, 1e-5)
    ):
        close(a, b, ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("shape", [(1, 2 * 8192), (129, 2 * 8192), (7, 2 * 3000)])
def test_silu_and_mul(shape):
    x = randn(*shape, dtype=BF16, device=DEV, g=gen(2)) * 3
    close(ops.silu_and_mul(x), reference.silu_and_mul(x), ELEMENTWISE_TOL[BF16])


@pytest.mark.parametrize(
    "hq,hkv,d,rot", [(32, 8, 64, 64), (32, 8, 128, 128), (16, 2, 128, 64), (8, 1, 256, 256)]
)
def test_rope_and_kv_writes(hq, hkv, d, rot):
    t, bs, layers = 300, 16, 2
    g = gen(3)
    q, k, v = (randn(t, h, d, dtype=BF16, device=DEV, g=g) for h in (hq, hkv, hkv))
    pos = torch.randint(0, 8000, (t,), generator=g).to(DEV)
    cs = cos_sin_cache(8192, rot, base=500000.0, device=DEV)
    tol = ELEMENTWISE_TOL[BF16]
    for a, b in zip(ops.apply_rope(q, k, pos, cs), reference.apply_rope(q, k, pos, cs)):
        close(a, b, tol)
    nb = t // bs + 4
    pool = randn(layers, 2, nb, bs, hkv, d, dtype=BF16, device=DEV, g=g)
    ref_pool = pool.clone()
    slots = torch.randperm(nb * bs, generator=g)[:t].to(DEV)
    q_out = ops.rope_and_write_kv(q, k, v, pos, cs, pool[1, 0], pool[1, 1], slots)
    q_ref = reference.rope_and_write_kv(q, k, v, pos, cs, ref_pool[1, 0], ref_pool[1, 1], slots)
    close(q_out, q_ref, tol)
    close(pool, ref_pool, tol)
    ops.write_kv_cache(k, v, pool[0, 0], pool[0, 1], slots)
    reference.write_kv_cache(k, v, ref_pool[0, 0], ref_pool[0, 1], slots)
    assert torch.equal(pool[0], ref_pool[0])


def test_pack_unpack_llama_1b():
    layers, nb, bs, hkv, d = 16, 300, 16, 8, 64
    kv = randn(layers, 2, nb, bs, hkv, d, dtype=BF16, device=DEV, g=gen(4))
    ids = torch.randperm(nb, generator=gen(5))[:100].to(DEV)
    packed = ops.pack_kv_blocks(kv, ids)
    assert torch.equal(packed, reference.pack_kv_blocks(kv, ids))
    target, target_ref = torch.zeros_like(kv), torch.zeros_like(kv)
    ops.unpack_kv_blocks(packed, target, ids)
    reference.unpack_kv_blocks(packed, target_ref, ids)
    assert torch.equal(target, target_ref)


def _decode(hq, hkv, d, bs, lens, dtype, seed=0, extra_cols=8):
    k_cache, v_cache, tables, ctx = paged_kv(
        lens, hkv, d, bs, dtype, device=DEV, seed=seed, extra_cols=extra_cols
    )
    q = randn(len(lens), hq, d, dtype=dtype, device=DEV, g=gen(seed + 1))
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, d**-0.5)
    close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, d**-0.5))
    assert not out[torch.tensor(lens, device=DEV) == 0].any()


@pytest.mark.parametrize(
    "lens", [[4096], [1, 17, 0, 3000, 2048, 999, 0, 64, 4095, 5, 2500, 16, 1200], [1024] * 64]
)
def test_decode_llama_1b(lens):
    _decode(32, 8, 64, 16, lens, BF16)


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 1, 256), (16, 16, 16), (28, 4, 128)])
def test_decode_head_dims(hq, hkv, d):
    _decode(hq, hkv, d, 16, [700, 0, 33, 2100], BF16)


def test_decode_fp32():
    _decode(8, 2, 64, 16, [300, 0, 1, 77], torch.float32)


def test_decode_cuda_graph():
    """Capture once, replay with new lengths / tables / queries: graph-safe split-KV (the
    split count is baked into the graph from shapes; lengths change freely)."""
    hq, hkv, d, bs, batch, max_blocks = 32, 8, 64, 16, 8, 64
    nb = batch * max_blocks + 1
    g = gen(6)
    k_cache = randn(nb, bs, hkv, d, dtype=BF16, device=DEV, g=g)
    v_cache = randn(nb, bs, hkv, d, dtype=BF16, device=DEV, g=g)
    q = torch.zeros(batch, hq, d, dtype=BF16, device=DEV)
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=DEV)
    lens = torch.zeros(batch, dtype=torch.int32, device=DEV)
    scale = d**-0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles every kernel before capture
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    for trial in range(4):
        new_lens = torch.randint(0, max_blocks * bs + 1, (batch,), generator=g, dtype=torch.int32)
        new_lens[trial % batch] = 0
        new_tables = (torch.randperm(nb - 1, generator=g)[: batch * max_blocks] + 1).view(
            batch, max_blocks
        )
        lens.copy_(new_lens)
        tables.copy_(new_tables.to(torch.int32))
        q.copy_(randn(batch, hq, d, dtype=BF16, g=g))
        graph.replay()
        torch.cuda.synchronize()
        close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))


@pytest.mark.parametrize(
    "hq,hkv,d,q_lens,lens",
    [
        (32, 8, 64, [1000, 1, 257, 0, 64], [1000, 700, 2000, 5, 64]),
        (32, 8, 64, [4096], [4096]),
        (32, 8, 128, [513, 100], [513, 1000]),
        (8, 1, 256, [300, 7], [300, 400]),
        (16, 16, 32, [129], [129]),
    ],
)
def test_prefill(hq, hkv, d, q_lens, lens):
    q, k_cache, v_cache, tables, cu, ctx = prefill_inputs(
        q_lens, lens, hq, hkv, d, 16, BF16, device=DEV
    )
    args = (q, k_cache, v_cache, tables, cu, ctx, max(q_lens), d**-0.5)
    close(ops.prefill_attention(*args), reference.prefill_attention(*args))


def test_prefill_fp32():
    q, k_cache, v_cache, tables, cu, ctx = prefill_inputs(
        [77, 1, 200], [77, 50, 333], 8, 2, 64, 16, torch.float32, device=DEV
    )
    args = (q, k_cache, v_cache, tables, cu, ctx, 200, 0.125)
    close(ops.prefill_attention(*args), reference.prefill_attention(*args))
