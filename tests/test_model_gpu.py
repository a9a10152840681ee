"""On CUDA the model runs through the Triton kernels; it must agree with the CPU reference."""

from __future__ import annotations

import pytest
import torch

from splitserve.config.engine_config import EngineConfig
from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.offline import OfflineEngine
from splitserve.request.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = [[1, 72, 101, 108, 108, 111], [1] + list(range(100, 177)), [1, 9]]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_cuda_greedy_equals_cpu(fixture, request):
    folder = str(request.getfixturevalue(fixture))
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    outs = {}
    for device in ("cpu", "cuda"):
        runner = ModelRunner(
            EngineConfig(model_path=folder, device=device, cache={"num_blocks": 64})
        )
        engine = OfflineEngine(runner)
        outs[device] = [c.token_ids for c in engine.generate(PROMPTS, params)]
        assert engine.allocator.num_free == engine.allocator.num_usable
    assert outs["cuda"] == outs["cpu"]


def test_cuda_bf16_prefill_logits_close_to_fp32(tiny_llama):
    ref = ModelRunner(
        EngineConfig(model_path=str(tiny_llama), device="cuda", cache={"num_blocks": 32})
    )
    bf16 = ModelRunner(
        EngineConfig(
            model_path=str(tiny_llama), device="cuda", dtype="bfloat16", cache={"num_blocks": 32}
        )
    )
    chunks = [PrefillChunk(p, 0, list(range(1 + 8 * i, 9 + 8 * i))) for i, p in enumerate(PROMPTS)]
    a, b = ref.prefill(chunks), bf16.prefill(chunks)
    assert torch.isfinite(b).all()
    assert (a - b).abs().max().item() < 0.25 * a.abs().max().item()
