"""The colocated decode worker's start-up (decode_worker/startup.py) keeps one CUDA graph pool:
the local prefill's piecewise graphs and the first token's sampler graphs are captured into the
pool the decode graphs' capture made (`graphs.pool`), after it; and the local prefill is warmed
by the prefill worker's own function (engine/prefill_warmup.warm_up_prefill) with the engine's
sampler, so a fix there (constrained first tokens) reaches both workers. No GPU: the capture
functions are replaced by recorders and the runner only claims to be on CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splitserve.decode_worker import startup
from splitserve.decode_worker.config import load
from splitserve.engine.sampler import Sampler


class _DecodeGraphs:
    """The decode GraphRunner's capture side: its pool exists once it has captured."""

    def __init__(self, events: list):
        self.events, self.pool, self.captured_sizes = events, None, []

    def capture(self, sizes, warmup_steps):
        self.pool = object()  # a fresh pool handle, as torch.cuda.graph_pool_handle()
        self.captured_sizes = list(sizes)
        self.events.append(("decode", self.pool))


def _engine(monkeypatch, tp: bool = False, **overrides):
    cfg = load(None, {"engine.model_path": "/m", **overrides})
    events: list = []
    runner = SimpleNamespace(
        device=torch.device("cuda", 0),
        tp=SimpleNamespace(enabled=tp),
        model_config=SimpleNamespace(vocab_size=96),
        zero_kv=lambda: events.append(("zero", None)),
    )
    sampler = Sampler(seed=0)
    monkeypatch.setattr(
        sampler, "capture_graphs", lambda vocab, dev, pool=None: events.append(("sampler", pool))
    )

    def capture_prefill(run, sizes, budget, pool=None):
        assert run is runner
        events.append(("prefill", pool, tuple(sizes or ()), budget))

    def warm_prefill(run, smp, budget, max_batch):
        assert run is runner
        events.append(("warm", smp, budget, max_batch))

    monkeypatch.setattr(startup, "capture_prefill_graphs", capture_prefill)
    monkeypatch.setattr(startup, "warm_up_prefill", warm_prefill)
    monkeypatch.setattr(startup, "warm_eager_steps", lambda graphs: [])
    engine = SimpleNamespace(
        cfg=cfg,
        runner=runner,
        graphs=_DecodeGraphs(events),
        sampler=sampler,
        max_batch_size=8,
        allocator=SimpleNamespace(num_usable=1000),
    )
    return engine, events


def test_prefill_and_sampler_graphs_go_into_the_decode_graphs_pool(monkeypatch):
    engine, events = _engine(monkeypatch, prefill_graph_sizes=[16, 64])
    assert startup.warm_up(engine) == engine.graphs.captured_sizes
    kinds = [e[0] for e in events]
    assert kinds == ["decode", "prefill", "sampler", "warm", "zero"]
    pool = engine.graphs.pool
    assert pool is not None and events[0][1] is pool
    assert events[1][1] is pool and events[2][1] is pool  # one pool for the worker
    # the local step budget: prefill_chunk_tokens (512) under max_num_batched_tokens (8192)
    assert events[1][2:] == ((16, 64), 512)
    assert events[3] == ("warm", engine.sampler, 512, 8)  # the shared warm-up, same sampler


@pytest.mark.parametrize(
    "overrides, tp, want",
    [
        ({}, True, ["decode", "prefill", "warm", "zero"]),  # TP: no sampler graphs
        ({"cuda_graph": False}, False, ["warm", "zero"]),  # --no-cuda-graph: nothing captured
    ],
)
def test_without_graphs_the_local_prefill_is_still_warmed(monkeypatch, overrides, tp, want):
    engine, events = _engine(monkeypatch, tp=tp, **overrides)
    startup.warm_up(engine)
    assert [e[0] for e in events] == want
    pools = [e[1] for e in events if e[0] in ("prefill", "sampler")]
    assert all(p is engine.graphs.pool for p in pools)
