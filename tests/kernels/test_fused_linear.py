"""Small-M fused linear kernels (add + RMSNorm + linear, SiLU-mul + linear, plain GEMV): Triton
vs torch reference on CPU (interpreter), odd shapes, M = 1..4; the op-level dispatch (GEMV
only at <= SMALL_M_MAX tokens); and the model with every kernel forced to Triton decoding the
same greedy tokens as the reference. The `gpu` set repeats the checks at Llama-3.2-1B shapes."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import TOL, cpu_interpreter, gen, randn

from splitserve.kernels import ops, reference
from splitserve.kernels.dispatch import force_triton

DTYPES = [torch.float32, torch.bfloat16]
# The kernels round every intermediate exactly like the reference (round to nearest even, also
# under the interpreter), so only the fp32 summation order differs: bf16 outputs agree to one ulp.
LIN_TOL = {
    torch.float32: TOL[torch.float32],
    torch.bfloat16: dict(atol=8e-3, rtol=8e-3),
    torch.float16: TOL[torch.float16],
}


def close(actual, expected, tol=None):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, **(tol or LIN_TOL[expected.dtype]))


def _linear_inputs(m, k, n, dtype, bias, device="cpu", seed=0):
    g = gen(seed)
    x = randn(m, k, dtype=dtype, device=device, g=g)
    wg = torch.Generator(device).manual_seed(
        seed
    )  # on the device: the lm_head weight is 262M values
    w = (torch.randn(n, k, generator=wg, device=device) / k**0.5).to(dtype)  # outputs O(1)
    b = randn(n, dtype=dtype, device=device, g=g) if bias else None
    return x, w, b


def _check_norm_linear(m, k, n, dtype, with_residual, bias, device="cpu", config=None, seed=0):
    from splitserve.kernels import triton_fused_linear as tfl

    x, w, b = _linear_inputs(m, k, n, dtype, bias, device, seed)
    g = gen(seed + 1)
    res = randn(m, k, dtype=dtype, device=device, g=g) if with_residual else None
    nw = (1 + 0.5 * randn(k, g=g)).to(dtype=dtype, device=device)
    x0 = x.clone()
    res0 = None if res is None else res.clone()
    out, summed = tfl.fused_add_rms_norm_linear_impl(x, res, nw, 1e-5, w, b, config=config)
    ref_out, ref_sum = reference.fused_add_rms_norm_linear(x, res, nw, 1e-5, w, b)
    close(out, ref_out)
    assert summed.dtype == ref_sum.dtype and torch.equal(summed, ref_sum)  # one rounding: bit-exact
    assert torch.equal(x, x0) and (res is None or torch.equal(res, res0))  # inputs untouched
    if res is None:
        assert summed is x


@cpu_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "with_residual,bias", [(True, True), (True, False), (False, True), (False, False)]
)
def test_fused_add_rms_norm_linear(dtype, m, with_residual, bias):
    _check_norm_linear(m, 200, 37, dtype, with_residual, bias, seed=m)


@cpu_interpreter
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("m", [1, 3])
def test_fused_add_rms_norm_linear_two_pass(dtype, m):
    """K wider than the default tile (1024 bf16 / 512 fp32): a separate RMS pass, masked K tail."""
    _check_norm_linear(m, 1100, 13, dtype, True, True, seed=m)


@cpu_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_silu_mul_linear(dtype, m, bias):
    from splitserve.kernels import triton_fused_linear as tfl

    _, w, b = _linear_inputs(m, 88, 45, dtype, bias, seed=m)
    gate_up = randn(m, 176, dtype=dtype, g=gen(m + 10)) * 2
    close(tfl.silu_mul_linear(gate_up, w, b), reference.silu_mul_linear(gate_up, w, b))


@cpu_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 4])
def test_linear_small_m(dtype, m):
    from splitserve.kernels import triton_fused_linear as tfl

    x, w, b = _linear_inputs(m, 136, 50, dtype, bias=m != 3, seed=m)
    close(tfl.linear_small_m(x, w, b), reference.linear_small_m(x, w, b))


@cpu_interpreter
@pytest.mark.parametrize(
    "block_n,block_k,num_stages,k,n",
    [
        (4, 32, 1, 96, 66),  # K a multiple of BLOCK_K: unmasked K loads, two passes; N tail
        (32, 64, 2, 200, 20),  # BLOCK_N wider than N; masked K tail; pipelined loop
        (8, 16, 1, 24, 8),  # K tail smaller than a tile
        (2, 128, 1, 96, 9),  # one K tile: the norm's RMS comes from the same tile, masked
        (4, 0, 1, 256, 12),  # automatic BLOCK_K (one 16-byte vector per thread): one unmasked tile
    ],
)
def test_explicit_configs(block_n, block_k, num_stages, k, n):
    from splitserve.kernels.triton_fused_linear import GemvConfig, silu_mul_linear_impl

    cfg = GemvConfig(block_n, num_warps=2, num_stages=num_stages, block_k=block_k)
    _check_norm_linear(3, k, n, torch.bfloat16, True, True, config=cfg)
    _, w, b = _linear_inputs(2, k, n, torch.float32, True, seed=5)
    gate_up = randn(2, 2 * k, g=gen(6))
    close(silu_mul_linear_impl(gate_up, w, b, config=cfg), reference.silu_mul_linear(gate_up, w, b))


@cpu_interpreter
def test_strided_input_rows():
    """Row-strided inputs (slices of wider activations) are read in place."""
    from splitserve.kernels import triton_fused_linear as tfl

    g = gen(7)
    x = randn(3, 300, g=g)[:, :120]
    res = randn(3, 200, g=g)[:, 50:170]
    nw, w = randn(120, g=g), randn(40, 120, g=g) / 11
    for a, b in zip(
        tfl.fused_add_rms_norm_linear(x, res, nw, 1e-6, w),
        reference.fused_add_rms_norm_linear(x, res, nw, 1e-6, w),
    ):
        close(a, b)


def test_pick_config(monkeypatch):
    from splitserve.kernels import triton_fused_linear as tfl

    cpu_dev = torch.device("cpu")  # pretends 4 SMs
    assert tfl.pick_config(3, 4096, 2048, cpu_dev) == tfl.pick_config(4, 4096, 2048, cpu_dev)
    cfg = tfl.pick_config(1, 10, 24, cpu_dev)  # narrow N: BLOCK_N shrinks
    assert cfg.block_n == tfl.MIN_BLOCK_N
    for m, base in tfl.CONFIGS.items():
        assert tfl.pick_config(m, 1 << 20, 8192, cpu_dev) == base
    tuned = tfl.GemvConfig(block_n=64, block_k=128, num_warps=8, num_stages=3)
    monkeypatch.setitem(tfl.TUNED, ("silu", 4, 40, 24), tuned)
    assert tfl.pick_config(3, 40, 24, cpu_dev, tfl.SILU) == tuned
    assert tfl.pick_config(3, 40, 24, cpu_dev, tfl.NORM) != tuned


@cpu_interpreter
def test_ops_dispatch_by_token_count():
    """<= SMALL_M_MAX tokens take the fused kernel; more take norm kernel + matmul; CPU without
    force takes the reference composition."""
    from splitserve.kernels import triton_fused_linear as tfl
    from splitserve.kernels import triton_norm

    g = gen(8)
    k, n = 64, 24
    nw, w = randn(k, g=g), randn(n, k, g=g) / 8
    small, res_small = randn(ops.SMALL_M_MAX, k, g=g), randn(ops.SMALL_M_MAX, k, g=g)
    big, res_big = randn(ops.SMALL_M_MAX + 1, k, g=g), randn(ops.SMALL_M_MAX + 1, k, g=g)
    with force_triton():
        out, summed = ops.fused_add_rms_norm_linear(small, res_small, nw, 1e-5, w)
        exp_out, exp_sum = tfl.fused_add_rms_norm_linear(small, res_small, nw, 1e-5, w)
        assert torch.equal(out, exp_out) and torch.equal(summed, exp_sum)
        out, summed = ops.fused_add_rms_norm_linear(big, res_big, nw, 1e-5, w)
        normed, exp_sum = triton_norm.fused_add_rms_norm(big, res_big, nw, 1e-5)
        assert torch.equal(out, torch.nn.functional.linear(normed, w)) and torch.equal(
            summed, exp_sum
        )
        gate_up = randn(ops.SMALL_M_MAX + 1, 2 * k, g=g)
        close(ops.silu_mul_linear(gate_up, w), reference.silu_mul_linear(gate_up, w))
        assert torch.equal(
            ops.linear_small_m(small, w, gemv=False), torch.nn.functional.linear(small, w)
        )
    out, summed = ops.fused_add_rms_norm_linear(small, res_small, nw, 1e-5, w)
    exp_out, exp_sum = reference.fused_add_rms_norm_linear(small, res_small, nw, 1e-5, w)
    assert torch.equal(out, exp_out) and torch.equal(summed, exp_sum)


@cpu_interpreter
def test_model_decode_with_triton_kernels_matches_reference(tiny_qwen2):
    """The whole model with every op forced to Triton (fused small-M GEMVs at decode, composed
    norm + matmul at prefill) gives the reference logits and greedy tokens: qkv bias, tied head."""
    from splitserve.config.engine_config import EngineConfig
    from splitserve.engine.model_runner import DecodeLane, ModelRunner, PrefillChunk

    runner = ModelRunner(
        EngineConfig(model_path=str(tiny_qwen2), cache={"num_blocks": 32, "block_size": 4})
    )
    prompts, tables = [[1, 5, 9, 200, 7, 3], [1, 42]], [[3, 4, 5, 6], [9, 10, 11, 12]]

    def run(triton: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
        runner.zero_kv()
        seqs = [list(p) for p in prompts]
        with force_triton(triton):
            logits = runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(prompts, tables)])
            out = [logits]
            for _ in range(2):
                for s, tok in zip(seqs, logits.argmax(-1).tolist()):
                    s.append(tok)
                logits = runner.decode(
                    [DecodeLane(s[-1], len(s) - 1, t) for s, t in zip(seqs, tables)]
                )
                out.append(logits)
        return out, seqs

    tri_logits, tri_seqs = run(True)
    ref_logits, ref_seqs = run(False)
    assert tri_seqs == ref_seqs
    for a, b in zip(tri_logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# --- GPU: Llama-3.2-1B shapes, bf16 -------------------------------------------------------------
@pytest.fixture
def exact_cublas(monkeypatch):
    """The reference's cuBLAS GEMV may reduce split-K partials in bf16 (torch's default): keep them
    fp32 so the reference is as exact as the kernel and one-ulp tolerances hold."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", False)


GPU_SHAPES = {  # name: (K, N)
    "qkv": (2048, 3072),
    "gate_up": (2048, 16384),
    "o_proj": (2048, 2048),
    "lm_head": (2048, 128256),
    "qwen_qkv": (896, 1152),  # K not a multiple of BLOCK_K
}


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_cublas")
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["qkv", "gate_up", "lm_head", "qwen_qkv"])
def test_gpu_norm_linear(name, m):
    k, n = GPU_SHAPES[name]
    _check_norm_linear(
        m, k, n, torch.bfloat16, True, name.startswith("qwen"), device="cuda", seed=m
    )
    if name == "qkv":
        _check_norm_linear(m, k, n, torch.bfloat16, False, False, device="cuda", seed=m)
        _check_norm_linear(m, k, n, torch.float32, True, True, device="cuda", seed=m)


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_cublas")
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gpu_silu_mul_linear_and_gemv(m):
    x, w, b = _linear_inputs(m, 8192, 2048, torch.bfloat16, bias=False, device="cuda", seed=m)
    gate_up = randn(m, 2 * 8192, dtype=torch.bfloat16, device="cuda", g=gen(m)) * 2
    close(ops.silu_mul_linear(gate_up, w, b), reference.silu_mul_linear(gate_up, w, b))
    x, w, b = _linear_inputs(m, 2048, 2048, torch.bfloat16, bias=True, device="cuda", seed=m)
    close(ops.linear_small_m(x, w, b), reference.linear_small_m(x, w, b))


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_cublas")
def test_gpu_fused_linear_cuda_graph():
    """Captured once, replayed on new inputs (the decode graph's use)."""
    k, n, m = 2048, 3072, 2
    x, w, _ = _linear_inputs(m, k, n, torch.bfloat16, False, device="cuda")
    res, nw = torch.zeros_like(x), torch.ones(k, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.fused_add_rms_norm_linear(x, res, nw, 1e-5, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, summed = ops.fused_add_rms_norm_linear(x, res, nw, 1e-5, w)
    for seed in range(3):
        x.copy_(randn(m, k, dtype=torch.bfloat16, device="cuda", g=gen(seed)))
        res.copy_(randn(m, k, dtype=torch.bfloat16, device="cuda", g=gen(seed + 10)))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_sum = reference.fused_add_rms_norm_linear(x, res, nw, 1e-5, w)
        close(out, ref_out)
        close(summed, ref_sum)
