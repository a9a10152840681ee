"""The graph runner's dispatch and padding logic on CPU: "graphs" that run the padded step
body eagerly stand in for captured ones, so padding lanes (null block, context 0), the
steady path and block patches run exactly as they do around a replay."""

from __future__ import annotations

import os
import random

import pytest
from decode_helpers import Collected, assert_all_free, drive, engine_config, make_engine, submit

from splitserve.decode_worker.config import capture_sizes, default_graph_sizes
from splitserve.decode_worker.graph_runner import MASK, VARIANTS
from splitserve.request.sampling_params import SamplingParams


class _EagerGraph:
    """A stand-in CUDAGraph: replay runs the body at the captured (padded) size."""

    def __init__(self, runner, size: int, variant: int) -> None:
        self.runner, self.key = runner, (size, variant)

    def replay(self) -> None:
        g, (n, variant) = self.runner, self.key
        if variant & MASK:  # the sampling half; _EagerForward ran the forward
            g._sample(n, variant, g._fwd_logits[n])
        else:
            g._graph_logits[self.key] = g._body(n, variant)

    def reset(self) -> None:
        pass


class _EagerForward(_EagerGraph):
    """The forward half of a MASK variant's pair."""

    def replay(self) -> None:
        self.runner._fwd_logits[self.key[0]] = self.runner._forward(self.key[0])


def _fake_capture(engine, sizes) -> None:
    g = engine.graphs
    g.bufs.reset()
    g._graphs = {(n, v): _EagerGraph(g, n, v) for n in sizes for v in VARIANTS}
    g._fwd_graphs = {n: _EagerForward(g, n, MASK) for n in sizes}
    g._pool = object()
    g._build_dispatch()


def test_default_and_capped_capture_sizes(tiny_llama):
    assert default_graph_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_graph_sizes(20) == [1, 2, 4, 8, 16, 24]
    cfg = engine_config(tiny_llama, max_batch_size=20)
    assert capture_sizes(cfg, 20, usable_blocks=1000) == [1, 2, 4, 8, 16]
    assert capture_sizes(cfg, 20, usable_blocks=6) == [1, 2, 4]
    cfg = engine_config(tiny_llama, cuda_graph_sizes=(64, 3, 8))
    assert capture_sizes(cfg, 16, usable_blocks=100) == [3, 8]


@pytest.mark.parametrize("sizes", [(1, 2, 4, 8), (4, 16)])
def test_padded_replays_give_the_tokens_of_the_unpadded_step(tiny_llama, oracle, sizes):
    engine = make_engine(tiny_llama, max_batch_size=16)
    _fake_capture(engine, sizes)
    assert engine.graphs.dispatch[3] == (4 if 4 in sizes else 0)
    assert engine.graphs.dispatch[11] == (16 if 16 in sizes else 0)  # 11 > 8: eager without 16
    rng = random.Random(len(sizes))
    col, want, arrivals = Collected(), {}, {}
    for i in range(11):
        prompt = [1] + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 12))]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(4, 20))
        want[f"q{i}"] = ref = oracle(prompt, params)
        arrivals.setdefault(rng.randrange(0, 10), []).append(
            lambda i=i, p=prompt, r=ref, sp=params: submit(
                engine, col, f"q{i}", p, r.token_ids[0], sp, i % 3 == 0
            )
        )
    drive(engine, arrivals)
    for rid, ref in want.items():
        assert col.tokens[rid] == ref.token_ids[1:], rid
    assert engine.graphs.num_replays > 0
    assert (
        engine.metrics.registry.get_sample_value("splitserve_decode_graph_replays_total")
        == engine.graphs.num_replays
    )
    assert engine.runner.kv_cache[:, :, 1:].abs().sum() > 0  # sanity: real KV went to real blocks
    assert_all_free(engine)
    engine.graphs.release()
    engine.graphs.release()  # idempotent
    assert engine.graphs.captured_sizes == [] and engine.graphs.dispatch[3] == 0


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="needs TRITON_INTERPRET=1 (set by conftest.py without CUDA)",
)
def test_padded_step_over_the_triton_kernels(tiny_llama, oracle):
    """The kernels the GPU graphs capture, run (interpreted) on the static-buffer slices with
    padding lanes: the tokens of isolated generation over the torch reference."""
    from splitserve.kernels.dispatch import force_triton

    prompts = [[1, 5, 9, 200, 7], [1, 300, 301, 302, 303, 304, 305, 306, 307], [1, 42]]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    refs = [oracle(p, params) for p in prompts]
    with force_triton():
        engine = make_engine(tiny_llama, max_batch_size=8)
        _fake_capture(engine, [4, 8])
        col = Collected()
        for i, (p, ref) in enumerate(zip(prompts, refs)):
            submit(engine, col, f"t{i}", p, ref.token_ids[0], params, with_kv=i != 1)
        drive(engine, {})
    for i, ref in enumerate(refs):
        assert col.tokens[f"t{i}"] == ref.token_ids[1:]
    assert engine.graphs.num_replays > 0
    assert_all_free(engine)
