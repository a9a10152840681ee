"""Fixtures of the decode-worker tests (helpers live in decode_helpers.py).

Without CUDA, the Triton-path test runs the kernels in Triton's interpreter, which must be
switched on before any kernel module is imported (as tests/kernels/conftest.py does)."""

from __future__ import annotations

import os

import pytest
import torch
from decode_helpers import MAX_MODEL_LEN

from splitserve.config.engine_config import EngineConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.offline import OfflineEngine
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.tokenizer import Tokenizer

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    """prompt, params -> all generated tokens (first included) of isolated generation."""
    runner = ModelRunner(
        EngineConfig(
            model_path=str(tiny_llama),
            cache={"num_blocks": 256, "block_size": 4},
            scheduler={"max_model_len": MAX_MODEL_LEN},
        )
    )
    engine = OfflineEngine(runner, Tokenizer.from_dir(tiny_llama))
    cache: dict = {}

    def generate(prompt: list[int], params: SamplingParams):
        key = (tuple(prompt), params)
        if key not in cache:
            [done] = engine.generate([prompt], [params])
            assert engine.allocator.num_free == engine.allocator.num_usable
            cache[key] = done
        return cache[key]

    return generate
