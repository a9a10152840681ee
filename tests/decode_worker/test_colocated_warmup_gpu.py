"""On CUDA, colocated prompts of random lengths (the decode worker's recompute path and its
first-token sampling) compile no Triton kernel after the decode engine's warm-up."""

from __future__ import annotations

import random

import pytest
from decode_helpers import Collected, assert_all_free, drive, make_engine

from splitserve.decode_worker.sequence import DecodeInput
from splitserve.kernels import compile_counter
from splitserve.request.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(rng, n: int, longest: int) -> list[list[int]]:
    return [
        [rng.randrange(3, 500) for _ in range(rng.choice([1, 2, 3, 5, rng.randint(1, longest)]))]
        for _ in range(n)
    ]


def test_colocated_prompts_compile_nothing_after_the_decode_warm_up(tiny_llama):
    compile_counter.install()
    engine = make_engine(tiny_llama, num_blocks=1024, block_size=16, max_batch_size=8)
    engine.warm_up()
    before, kernels = compile_counter.compilations(), compile_counter.by_kernel()
    rng = random.Random(35)
    params = [
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=3),
    ]
    col = Collected()
    prompts = _prompts(rng, 20, engine.runner.max_model_len - 64)
    arrivals = {
        2 * i: [
            lambda i=i, p=p: engine.submit(
                DecodeInput(f"c{i}", p, None, params[i % 3]), col.sink(f"c{i}")
            )
        ]
        for i, p in enumerate(prompts)
    }
    drive(engine, arrivals, max_steps=5000)
    assert len(col.final) == len(prompts)
    new = {k: n - kernels.get(k, 0) for k, n in compile_counter.by_kernel().items()}
    assert compile_counter.compilations() == before, {k: n for k, n in new.items() if n}
    assert_all_free(engine)
