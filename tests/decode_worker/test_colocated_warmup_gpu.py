"""On CUDA, colocated prompts of random lengths (the decode worker's recompute path and its
first-token sampling) compile no Triton kernel after the decode engine's warm-up, and chunked
prefill between CUDA-graph replays keeps every token."""

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


def _colocated_tokens(engine, prompts, params) -> dict[str, list[int]]:
    col = Collected()
    arrivals = {
        3 * i: [
            lambda i=i, p=p: engine.submit(
                DecodeInput(f"c{i}", p, None, params[i % len(params)]), col.sink(f"c{i}")
            )
        ]
        for i, p in enumerate(prompts)
    }
    drive(engine, arrivals, max_steps=5000)
    assert_all_free(engine)
    return dict(col.tokens)


def test_chunked_prefill_between_graph_replays_keeps_the_tokens(tiny_llama):
    """Chunks of a colocated prompt run between CUDA-graph decode replays whose rows did not
    change (no re-prepare): the running rows' tokens and the prompt's own equal whole-prompt
    prefill without graphs."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 120))] for _ in range(8)]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True),
    ]
    chunked = make_engine(
        tiny_llama, num_blocks=1024, block_size=16, max_batch_size=8, prefill_chunk_tokens=16
    )
    chunked.warm_up()
    whole = make_engine(
        tiny_llama,
        num_blocks=1024,
        block_size=16,
        max_batch_size=8,
        prefill_chunk_tokens=0,
        cuda_graph=False,
    )
    assert chunked.graphs.captured_sizes
    assert _colocated_tokens(chunked, prompts, params) == _colocated_tokens(whole, prompts, params)
