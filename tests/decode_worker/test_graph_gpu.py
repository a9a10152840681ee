"""CUDA-graph decode on the GPU (run through the device tool): replays give the tokens of
the eager path for batches that need padding, batches larger than the largest graph fall
back to eager, the replay counter moves, and warm-up leaves no KV behind."""

from __future__ import annotations

import random

import pytest
import torch
from decode_helpers import Collected, assert_all_free, drive, engine_config, submit

from splitserve.decode_worker.engine import DecodeEngine
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.7, seed=7, max_tokens=24, ignore_eos=True)


def _engine(model, graphs: bool, **kw) -> DecodeEngine:
    cfg = engine_config(
        model,
        num_blocks=kw.pop("num_blocks", 1024),
        block_size=4,
        max_batch_size=kw.pop("max_batch_size", 64),
        cuda_graph=graphs,
        **kw,
    )
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"device": "cuda"})})
    engine = DecodeEngine(cfg, tokenizer=Tokenizer.from_dir(model))
    engine.warm_up()
    return engine


MIXED = [
    GREEDY,
    SEEDED,
    SamplingParams(seed=3, top_k=20, top_p=0.8, max_tokens=24, ignore_eos=True),
    SamplingParams(
        temperature=0, repetition_penalty=1.3, presence_penalty=0.4, max_tokens=24, ignore_eos=True
    ),
    SamplingParams(seed=4, logprobs=5, min_p=0.05, max_tokens=24, ignore_eos=True),
    SamplingParams(seed=5, logit_bias={7: 5.0}, min_tokens=6, max_tokens=24),
]


def _run(engine: DecodeEngine, n: int, seed: int, mixed: bool = False) -> dict[str, list[int]]:
    rng = random.Random(seed)
    col = Collected()
    for i in range(n):
        prompt = [1] + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 40))]
        params = MIXED[i % len(MIXED)] if mixed else (SEEDED if i == 1 else GREEDY)
        submit(engine, col, f"g{i}", prompt, rng.randrange(3, 500), params, with_kv=i % 2 == 0)
    drive(engine, {})
    assert_all_free(engine)
    return dict(col.tokens)


def _replays(engine: DecodeEngine) -> float:
    return engine.metrics.registry.get_sample_value("splitserve_decode_graph_replays_total")


@pytest.fixture(scope="module")
def graph_engine(tiny_llama):
    engine = _engine(tiny_llama, graphs=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def eager_engine(tiny_llama):
    engine = _engine(tiny_llama, graphs=False)
    yield engine
    engine.close()


def test_capture_sizes_and_clean_null_block(graph_engine):
    assert graph_engine.graphs.captured_sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_engine.graphs.dispatch[3] == 4 and graph_engine.graphs.dispatch[50] == 56
    assert torch.count_nonzero(graph_engine.runner.kv_cache[:, :, 0]) == 0


@pytest.mark.parametrize("batch", [3, 13, 50])
def test_graph_replay_matches_eager_with_padding(graph_engine, eager_engine, batch):
    before = _replays(graph_engine)
    eager_before = graph_engine.graphs.num_eager
    got = _run(graph_engine, batch, seed=batch)
    want = _run(eager_engine, batch, seed=batch)
    assert got == want
    assert _replays(graph_engine) > before + 20
    assert graph_engine.graphs.num_eager == eager_before  # every batch size had a graph
    assert eager_engine.graphs.num_replays == 0


@pytest.mark.parametrize("batch", [6, 29])
def test_mixed_sampling_rows_replay_like_eager_without_host_sync(graph_engine, eager_engine, batch):
    """Greedy, seeded, filtered, penalised, logprobs, bias and min_tokens rows in one batch:
    the captured step gives the eager step's tokens (same counter-based noise), and the host
    never waits for a step it has just launched."""
    syncs, replays = graph_engine.sync_reads, _replays(graph_engine)
    got = _run(graph_engine, batch, seed=batch, mixed=True)
    assert got == _run(eager_engine, batch, seed=batch, mixed=True)
    assert graph_engine.sync_reads == syncs == 0
    assert _replays(graph_engine) > replays + 20


def test_eager_fallback_above_the_largest_graph(tiny_llama, eager_engine):
    engine = _engine(tiny_llama, graphs=True, max_batch_size=16, cuda_graph_sizes=(1, 2, 4, 8))
    try:
        assert engine.graphs.captured_sizes == [1, 2, 4, 8] and engine.graphs.dispatch[13] == 0
        got = _run(engine, 13, seed=13)
        assert got == _run(eager_engine, 13, seed=13)
        eager = engine.metrics.registry.get_sample_value("splitserve_decode_eager_steps_total")
        assert eager > 0 and engine.graphs.num_eager == eager and _replays(engine) == 0
    finally:
        engine.close()
        engine.graphs.release()  # idempotent


def test_preemption_with_graphs_keeps_tokens(tiny_llama, eager_engine):
    engine = _engine(tiny_llama, graphs=True, max_batch_size=8, num_blocks=61)
    try:
        want = _run(eager_engine, 8, seed=99)
        got = _run(engine, 8, seed=99)
        assert engine.scheduler.num_preemptions > 0
        assert got == want
    finally:
        engine.close()
