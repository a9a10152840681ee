"""kernels/dense_attention.py: the dense causal call of a fresh prompt agrees with the varlen
kernel (the torch reference here), at a bucket's padded size too, and its start-up self-check
turns the dense path off where a backend computes something else."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import dense_attention, ops
from splitserve.kernels.dense_attention import dense_causal_attention, dense_disagrees


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
    from splitserve.config.engine_config import EngineConfig
    from splitserve.engine import prefill_graphs
    from splitserve.engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model_path=str(tiny_llama), device="cpu"))
    sizes = [16, prefill_graphs.DENSE_MIN_TOKENS]
    graphs = prefill_graphs.PrefillGraphs(runner.model, runner.kv_cache, runner.cos_sin, sizes)
    assert graphs._build_dense_plans() is True  # (a CPU runner never captures: called here)

    real = F.scaled_dot_product_attention

    def not_causal(*args, **kwargs):
        return real(*args, **{**kwargs, "is_causal": False})

    monkeypatch.setattr(dense_attention.F, "scaled_dot_product_attention", not_causal)
    bad = dense_disagrees(torch.zeros(1, 8, 16), 2, 4, 0.25, 37)
    assert bad is not None and "max difference" in bad
    with caplog.at_level(logging.WARNING, logger=prefill_graphs.__name__):
        assert graphs._build_dense_plans() is False
    assert "dense prefill attention off" in caplog.text and "max difference" in caplog.text
