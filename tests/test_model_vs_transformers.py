"""The engine's model equals transformers (the oracle) on the same checkpoint folder."""

from __future__ import annotations

import pytest
import torch

from splitserve.config.engine_config import EngineConfig
from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.offline import OfflineEngine
from splitserve.request.sampling_params import SamplingParams

PROMPTS = [
    [1, 72, 101, 108, 108, 111, 44, 32, 119],
    [1, 200],
    [1] + list(range(300, 337)),
    [1, 7, 9, 11, 13],
]


def _hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(params=["tiny_llama", "tiny_qwen2"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


def test_greedy_32_tokens_match_transformers(checkpoint):
    runner = ModelRunner(
        EngineConfig(model_path=str(checkpoint), cache={"num_blocks": 96, "block_size": 4})
    )
    engine = OfflineEngine(runner)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    done = engine.generate(PROMPTS, [params] * len(PROMPTS))
    hf = _hf(checkpoint)
    for prompt, seq in zip(PROMPTS, done):
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            min_new_tokens=32,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert seq.token_ids == ref
        assert seq.finish_reason == "length"
    engine.allocator.check_integrity()
    assert engine.allocator.num_free == engine.allocator.num_usable


def test_prefill_logits_match_transformers(checkpoint):
    runner = ModelRunner(
        EngineConfig(model_path=str(checkpoint), cache={"num_blocks": 64, "block_size": 8})
    )
    tables = [[1, 2], [3], [4, 5, 6, 7, 8], [9]]
    logits = runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(PROMPTS, tables)])
    hf = _hf(checkpoint)
    with torch.no_grad():
        for row, prompt in zip(logits, PROMPTS):
            ref = hf(torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(row, ref, atol=1e-4, rtol=1e-4)
