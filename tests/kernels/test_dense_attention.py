"""kernels/dense_attention.py: the dense causal call of a fresh prompt agrees with the varlen
kernel (the torch reference here), at a bucket's padded size too, and its start-up self-check
turns the dense path off where a backend computes something else."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from splitserve.config.engine_config import EngineConfig
from splitserve.engine import prefill_dense
from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.prefill_dense import (
    build_dense_plans,
    check_dense,
    dense_len,
    dense_lengths,
)
from splitserve.engine.prefill_graphs import PrefillGraphs
from splitserve.kernels import dense_attention, ops
from splitserve.kernels.dense_attention import dense_causal_attention, dense_disagrees


def _runner(model) -> ModelRunner:
    cfg = EngineConfig(
        model_path=str(model),
        device="cpu",
        cache={"num_blocks": 300, "block_size": 4},
        scheduler={"max_model_len": 1024, "max_num_batched_tokens": 1024},
    )
    return ModelRunner(cfg)


def test_dense_lengths_pad_to_a_sixteenth_of_the_bucket_never_past_it(monkeypatch):
    assert [dense_len(8192, t) for t in (4097, 5000, 8192)] == [4608, 5120, 8192]
    assert [dense_len(2048, t) for t in (1025, 1300, 2048)] == [1280, 1536, 2048]
    assert dense_len(300, 290) == 300  # a bucket that is no multiple of the step
    monkeypatch.setattr(prefill_dense, "DENSE_MIN_TOKENS", 2048)
    sizes = [16, 1024, 2048, 4096]
    assert dense_lengths(sizes) == list(range(1280, 4097, 256))  # one plan each, at capture


def test_a_fresh_prompt_padded_inside_its_bucket_matches_the_eager_step(tiny_llama, monkeypatch):
    """Dense at 768 rows of the 1024 bucket, on the thread that built the plans only (torch
    keeps cuDNN's per thread): another thread gets the varlen kernel until it builds its own."""
    eager, dense = _runner(tiny_llama), _runner(tiny_llama)
    graphs = dense.prefill_graphs = PrefillGraphs(
        dense.model, dense.kv_cache, dense.cos_sin, [16, 1024], dense.max_blocks_per_seq
    )
    monkeypatch.setattr(prefill_dense, "DENSE_MIN_TOKENS", 1024)
    graphs.dense = check_dense(graphs)
    graphs.prepare_dense_here()
    prompt = [(37 * i) % 500 + 3 for i in range(600)]
    chunk = [PrefillChunk(prompt, 0, list(range(1, 151)))]
    want = eager.prefill(chunk)
    torch.testing.assert_close(dense.prefill(chunk), want, atol=1e-4, rtol=1e-4)
    assert graphs.num_dense == 1 and dense_len(1024, 600) == 768

    def elsewhere(prepare: bool) -> None:
        if prepare:
            graphs.prepare_dense_here()
        torch.testing.assert_close(dense.prefill(chunk), want, atol=1e-4, rtol=1e-4)

    for steps, (prepare, dense_steps) in enumerate(((False, 1), (True, 2)), start=2):
        with ThreadPoolExecutor(1) as pool:
            pool.submit(elsewhere, prepare).result()
        assert (graphs.num_steps, graphs.num_dense) == (steps, dense_steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_self_check_agrees_with_the_varlen_kernel(dtype):
    assert dense_disagrees(torch.zeros(1, 8, 16, dtype=dtype), 2, 4, 0.25, 37) is None


def test_padding_rows_after_the_prompt_change_none_of_its_rows():
    torch.manual_seed(0)
    n, pad, bs = 21, 11, 4
    q = torch.randn(n + pad, 4, 8)
    k_cache, v_cache = torch.randn(2, 9, bs, 2, 8).unbind(0)
    slots = torch.cat([torch.arange(bs, bs + n), torch.zeros(pad, dtype=torch.long)])  # null slot
    out = torch.empty_like(q)
    dense_causal_attention(q, k_cache, v_cache, slots, 0.3, out)
    cu = torch.tensor([0, n], dtype=torch.int32)
    table = torch.arange(1, 9, dtype=torch.int32)[None]
    want = ops.prefill_attention(q[:n], k_cache, v_cache, table, cu, cu[1:].clone(), n, 0.3)
    torch.testing.assert_close(out[:n], want, atol=1e-5, rtol=1e-5)


def test_the_self_check_catches_a_backend_that_computes_something_else(
    monkeypatch, caplog, tiny_llama
):
    runner = _runner(tiny_llama)
    graphs = PrefillGraphs(runner.model, runner.kv_cache, runner.cos_sin, [16, 512, 1024])
    monkeypatch.setattr(prefill_dense, "DENSE_MIN_TOKENS", 1024)
    assert check_dense(graphs) is True  # (a CPU runner never captures: called here)
    assert build_dense_plans(graphs) is True

    real = F.scaled_dot_product_attention

    def not_causal(*args, **kwargs):
        return real(*args, **{**kwargs, "is_causal": False})

    monkeypatch.setattr(dense_attention.F, "scaled_dot_product_attention", not_causal)
    bad = dense_disagrees(torch.zeros(1, 8, 16), 2, 4, 0.25, 37)
    assert bad is not None and "max difference" in bad
    with caplog.at_level(logging.WARNING, logger=prefill_dense.__name__):
        assert check_dense(graphs) is False
    assert "dense prefill attention off" in caplog.text and "max difference" in caplog.text
