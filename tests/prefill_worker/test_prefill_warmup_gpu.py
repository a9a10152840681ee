"""On CUDA, after SERVING no Triton kernel compiles: 50 prompts of random lengths (packed,
chunked, prefix-cache hits, every sampling variant, constrained with and without logprobs)
through a prefill worker, and colocated prompts through a decode engine's recompute path, leave
the compilation counter where warm-up left it (kernels/compile_counter.py)."""

from __future__ import annotations

import asyncio
import random

import pytest
from prefill_helpers import prefill_request, release, serving, worker_config

from splitserve.prefill_worker.config import PrefillWorkerConfig
from splitserve.protos import generate_pb2

pytestmark = pytest.mark.gpu

SAMPLING = [
    generate_pb2.SamplingParams(temperature=0.0, max_tokens=4),
    generate_pb2.SamplingParams(temperature=0.9, seed=5, max_tokens=4),
    generate_pb2.SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=6, max_tokens=4),
    generate_pb2.SamplingParams(temperature=0.0, logprobs=3, max_tokens=4),
    generate_pb2.SamplingParams(temperature=1.0, repetition_penalty=1.2, seed=7, max_tokens=4),
    # constrained: the sampler's masked eager path, even at one row (no sampler graph)
    generate_pb2.SamplingParams(temperature=0.0, json_object=True, max_tokens=4),
    generate_pb2.SamplingParams(
        temperature=0.9, top_p=0.9, seed=8, regex="[a-z]{1,12}", logprobs=2, max_tokens=4
    ),
]


def _prompts(rng, n: int, longest: int) -> list[list[int]]:
    shared = [rng.randrange(3, 500) for _ in range(40)]
    return [
        (shared if rng.random() < 0.3 else [])
        + [rng.randrange(3, 500) for _ in range(rng.choice([1, 2, 3, 5, rng.randint(1, longest)]))]
        for _ in range(n)
    ]


def test_no_kernel_compiles_after_serving_across_50_random_prompts(tiny_llama):
    data = worker_config(
        tiny_llama, num_blocks=2048, block_size=16, budget=2048, max_queue_len=64
    ).model_dump()
    data["engine"]["device"] = "cuda"
    cfg = PrefillWorkerConfig.model_validate({**data, "warmup": True})
    rng = random.Random(31)

    async def body():
        async with serving(cfg) as (worker, stub):
            longest = worker.engine.max_model_len - 64
            prompts = _prompts(rng, 50, longest)

            async def one(i: int, prompt: list[int]) -> None:
                req = prefill_request(f"p{i}", prompt, SAMPLING[i % len(SAMPLING)])
                resp = await stub.Prefill(req)
                if resp.HasField("kv"):
                    await release(stub, resp)

            for wave in range(0, 50, 5):  # a few prompts at a time: packed steps
                await asyncio.gather(*(one(i, prompts[i]) for i in range(wave, wave + 5)))
            assert worker.kernel_compiles.serving == 0, worker.kernel_compiles.new_since_serving()

    asyncio.run(body())
