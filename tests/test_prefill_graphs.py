"""Piecewise prefill graphs' bucket padding (engine/prefill_graphs.py), checked on CPU through
its padded eager path: packed batches of mixed lengths, chunked prompts and prefix-cache hits
give the plain eager step's logits, first tokens and KV; steps above the largest bucket fall
back to the plain eager step."""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import pytest
import torch

from splitserve.config.engine_config import EngineConfig
from splitserve.engine import prefill_dense, prefill_graphs
from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.prefill_graph_sizes import default_sizes, graph_sizes
from splitserve.engine.prefill_graphs import FUSED_SEQS, PrefillGraphs

BS = 4
SIZES = [16, 32, 64]


def _runner(model) -> ModelRunner:
    cfg = EngineConfig(
        model_path=str(model),
        device="cpu",
        cache={"num_blocks": 96, "block_size": BS},
        scheduler={"max_model_len": 256},
    )
    return ModelRunner(cfg)


@pytest.fixture(scope="module")
def pair(tiny_llama):
    """(eager runner, bucketed runner): same weights, separate KV pools."""
    bucketed = _runner(tiny_llama)
    bucketed.prefill_graphs = PrefillGraphs(
        bucketed.model, bucketed.kv_cache, bucketed.cos_sin, SIZES, bucketed.max_blocks_per_seq
    )
    return _runner(tiny_llama), bucketed


def _same_step(pair, chunks: list[PrefillChunk], bucketed_path: bool) -> None:
    eager, bucketed = pair
    steps = bucketed.prefill_graphs.num_steps
    want, got = eager.prefill(chunks), bucketed.prefill(chunks)
    assert bucketed.prefill_graphs.num_steps == steps + bucketed_path
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    used = sorted({b for c in chunks for b in c.block_table})  # real blocks (never the null one)
    torch.testing.assert_close(
        bucketed.kv_cache[:, :, used], eager.kv_cache[:, :, used], atol=1e-5, rtol=1e-5
    )


def _prompt(rng, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def _tables(lengths: list[int], first: int = 1) -> list[list[int]]:
    out = []
    for n in lengths:
        k = -(-n // BS)
        out.append(list(range(first, first + k)))
        first += k
    return out


def test_buckets():
    assert default_sizes(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert default_sizes(1000) == [16, 32, 64, 128, 256, 512]
    g = PrefillGraphs.__new__(PrefillGraphs)
    g.sizes = SIZES
    assert [g.bucket(t) for t in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, 0]


def test_graph_sizes_above_the_step_budget_are_captured_at_the_budget():
    assert graph_sizes(None, 100) == default_sizes(100) == [16, 32, 64]
    assert graph_sizes([16, 64, 256, 4096], 100) == [16, 64, 100]  # 65..100 keep a graph
    assert graph_sizes([16, 100, 200], 100) == [16, 100]
    assert graph_sizes([4096, 512], 100) == [100]
    assert graph_sizes([64, 16, 16, 8192], 8192) == [16, 64, 8192]  # within it: as given


def test_capture_builds_no_graph_above_the_step_budget(monkeypatch):
    """capture_prefill_graphs (both workers' start-up) builds and captures the capped sizes,
    into the pool it is given (no GPU: PrefillGraphs recorded)."""
    made = []

    class Recorded:
        def __init__(self, model, kv_cache, cos_sin, sizes, max_blocks):
            self.sizes, self.pool = list(sizes), "none yet"
            made.append(self)

        def capture(self, pool=None):
            self.pool = pool

    monkeypatch.setattr(prefill_graphs, "PrefillGraphs", Recorded)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    runner = SimpleNamespace(
        device=torch.device("cuda", 0),
        tp=SimpleNamespace(enabled=False),
        model=None,
        kv_cache=None,
        cos_sin=None,
        max_blocks_per_seq=8,
        prefill_graphs=None,
    )
    pool = object()
    graphs = prefill_graphs.capture_prefill_graphs(runner, (16, 64, 512, 8192), 256, pool)
    assert graphs is runner.prefill_graphs is made[-1]
    assert graphs.sizes == [16, 64, 256] and graphs.pool is pool
    assert prefill_graphs.capture_prefill_graphs(runner, None, 100).sizes == [16, 32, 64]
    runner.tp.enabled = True  # followers replay rank 0's commands: no graphs
    assert prefill_graphs.capture_prefill_graphs(runner, (16,), 256) is None and len(made) == 2


def test_packed_batches_of_mixed_lengths_match_the_eager_step(pair):
    rng = random.Random(1)
    graphs = pair[1].prefill_graphs
    for lengths in ([1], [5, 17, 9], [16], [3, 3, 3, 3, 3], [40, 2, 20], [6, 1, 9, 30]):
        prompts = [_prompt(rng, n) for n in lengths]
        chunks = [PrefillChunk(p, 0, t) for p, t in zip(prompts, _tables(lengths))]
        fused = graphs.num_fused
        _same_step(pair, chunks, bucketed_path=True)
        # up to FUSED_SEQS sequences: fused pieces (attention inside); more: the plain pieces
        assert graphs.num_fused == fused + (len(lengths) <= FUSED_SEQS)


def test_the_streaming_hook_sees_every_layer_on_both_paths(pair):
    graphs, seen = pair[1].prefill_graphs, []
    graphs.on_layer_kv = seen.append
    rng = random.Random(4)
    try:
        for lengths in ([12], [2, 2, 2, 2, 2]):  # fused, then plain pieces
            seen.clear()
            prompts = [_prompt(rng, n) for n in lengths]
            chunks = [PrefillChunk(p, 0, t) for p, t in zip(prompts, _tables(lengths, first=70))]
            _same_step(pair, chunks, True)
            assert seen == list(range(graphs.num_layers))
    finally:
        graphs.on_layer_kv = None


def test_chunked_prompts_and_prefix_hits_match_the_eager_step(pair):
    rng = random.Random(2)
    long, other = _prompt(rng, 50), _prompt(rng, 13)
    t_long, t_other = _tables([50, 13])
    # a 50-token prompt in chunks of 20, 20, 10, the second chunk packed with another prompt
    _same_step(pair, [PrefillChunk(long[:20], 0, t_long)], True)
    _same_step(pair, [PrefillChunk(long[20:40], 20, t_long), PrefillChunk(other, 0, t_other)], True)
    _same_step(pair, [PrefillChunk(long[40:], 40, t_long)], True)
    # a prefix-cache hit: the first 8 blocks of `long` shared, 7 new tokens after them
    hit = long[:32] + _prompt(rng, 7)
    table = t_long[:8] + [t_other[-1] + 1, t_other[-1] + 2]
    _same_step(pair, [PrefillChunk(hit[32:], 32, table)], True)


def test_steps_above_the_largest_bucket_take_the_eager_step(pair):
    rng = random.Random(3)
    lengths = [40, 30]  # 70 tokens > 64
    prompts = [_prompt(rng, n) for n in lengths]
    chunks = [PrefillChunk(p, 0, t) for p, t in zip(prompts, _tables(lengths, first=60))]
    _same_step(pair, chunks, bucketed_path=False)


def test_fresh_single_prompts_take_dense_attention_and_match_the_eager_step(pair, monkeypatch):
    """kernels/dense_attention.py (the math backend here, cuDNN on CUDA), padded to the bucket
    here (engine/prefill_dense.py `dense_len`: at least 256): a single prompt with nothing cached;
    packed steps and prefix hits keep the varlen kernel."""
    graphs = pair[1].prefill_graphs
    monkeypatch.setattr(prefill_dense, "DENSE_MIN_TOKENS", 32)
    monkeypatch.setattr(graphs, "dense_threads", set())
    monkeypatch.setattr(graphs, "dense", prefill_dense.check_dense(graphs))
    graphs.prepare_dense_here()
    assert graphs.dense
    rng = random.Random(5)
    for n, dense in ((5, False), (16, False), (17, True), (32, True), (64, True)):
        before, fused = graphs.num_dense, graphs.num_fused
        _same_step(pair, [PrefillChunk(_prompt(rng, n), 0, _tables([n], first=40)[0])], True)
        assert graphs.num_dense == before + dense  # buckets under the floor: fused pieces
        assert graphs.num_fused == fused + (not dense)
    long = _prompt(rng, 60)
    t_long, t_other = _tables([60, 30], first=40)
    before = graphs.num_dense
    _same_step(pair, [PrefillChunk(long[:36], 0, t_long)], True)  # a first chunk: fresh
    _same_step(pair, [PrefillChunk(long[36:], 36, t_long)], True)  # a later chunk: cached part
    _same_step(
        pair, [PrefillChunk(long[:30], 0, t_long), PrefillChunk(long[:30], 0, t_other)], True
    )
    assert graphs.num_dense == before + 1
