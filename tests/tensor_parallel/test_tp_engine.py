"""Tensor parallelism in the engine (CPU, gloo, 2 ranks as real processes): the TP2 model equals
the TP1 model token for token (greedy) with close logits, each rank holds only its slices (heads,
MLP columns, vocab rows of the embedding / lm_head, tied or not, vocab divisible by 2 or not), and
a model that does not split is refused with a one-line error naming the field."""

from __future__ import annotations

import pytest
import torch

from splitserve.config.engine_config import EngineConfig, ParallelConfig
from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.offline import OfflineEngine
from splitserve.engine.tp_control import start_ranks
from splitserve.request.sampling_params import SamplingParams

# ids on both sides of the 2-rank vocab split (254 | 255 | 256) and the last id of a 509-row vocab
PROMPTS = [
    [1, 72, 101, 108, 108, 111, 44, 32, 119],
    [1, 200],
    [1] + list(range(300, 337)),
    [1, 0, 254, 255, 256, 508, 507],
]
TABLES = [[1, 2], [3], [4, 5, 6, 7, 8], [9]]


def _cfg(folder, tp: int) -> EngineConfig:
    return EngineConfig(
        model_path=str(folder),
        device="cpu",
        cache={"num_blocks": 96, "block_size": 8},
        parallel={"tensor_parallel_size": tp},
    )


@pytest.fixture(params=["tiny_llama", "tiny_qwen2", "tiny_llama_odd_vocab", "tiny_qwen2_odd_vocab"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


def test_tp2_greedy_and_logits_equal_tp1(checkpoint):
    ref_runner = ModelRunner(_cfg(checkpoint, 1))
    ref_logits = ref_runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(PROMPTS, TABLES)])
    ref_runner.zero_kv()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = [
        c.token_ids for c in OfflineEngine(ref_runner).generate(PROMPTS, [params] * len(PROMPTS))
    ]

    ranks = start_ranks(_cfg(checkpoint, 2))
    runner, procs = ranks.runner, ranks.procs
    try:
        assert runner.kv_cache.shape[4] == 1 and runner.kv_head_range == (
            0,
            1,
        )  # 2 KV heads over 2 ranks
        layer = runner.model.layers[0]
        assert layer.qkv_weight.shape[0] == (2 + 2 * 1) * 16 and layer.down_weight.shape[1] == 88
        model, vocab = runner.model, runner.model_config.vocab_size
        assert (
            model.embed.shape == (-(-vocab // 2), 64) and model.lm_head.shape == model.embed.shape
        )
        assert (model.lm_head is model.embed) == runner.model_config.tie_word_embeddings
        logits = runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(PROMPTS, TABLES)])
        assert logits.shape == ref_logits.shape == (len(PROMPTS), vocab)  # padding sliced off
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
        runner.zero_kv()
        engine = OfflineEngine(runner)
        got = [c.token_ids for c in engine.generate(PROMPTS, [params] * len(PROMPTS))]
        assert got == ref
        engine.allocator.check_integrity()
        assert engine.allocator.num_free == engine.allocator.num_usable
    finally:
        ranks.close()
    assert all(p.exitcode == 0 for p in procs)


def test_indivisible_model_is_refused_naming_the_field(tiny_llama):
    with pytest.raises(
        ValueError,
        match=r"^parallel.tensor_parallel_size 3 does not divide the model's "
        r"num_attention_heads \(4\)",
    ):
        ModelRunner(_cfg(tiny_llama, 3))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
