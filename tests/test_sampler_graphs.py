"""The host sampler's kept buffers (sampler.py `_buffers`) and first-token graphs
(engine/sampler_graphs.py): a call never sees a previous call's bias, bans or penalty counts,
and on CUDA the graph replay gives the eager path's tokens and logprobs exactly."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.sampler import Sampler, SeqSamplingInfo
from splitserve.engine.sampler_graphs import GRAPH_ROWS, row_buckets
from splitserve.request.sampling_params import SamplingParams as SP


def info(params: SP, prompt=(1, 2, 3), output=()) -> SeqSamplingInfo:
    return SeqSamplingInfo(params, list(prompt), list(output))


def logits_for(n: int, v: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g) * 3).to(device)


def test_row_buckets():
    assert row_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert row_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert row_buckets(1) == [1]


def test_kept_state_forgets_the_previous_calls_bias_bans_and_penalties():
    sampler, v = Sampler(seed=3, eos_token_ids=(2,)), 64
    logits = logits_for(1, v, seed=1)
    best = int(logits.argmax())
    cold = SP(temperature=1e-4, seed=9)  # sampled path, but the argmax wins
    assert sampler.sample(logits.clone(), [info(cold)]).token_ids == [best]
    forced = SP(temperature=1e-4, seed=9, logit_bias=((5, 100.0),))
    assert sampler.sample(logits.clone(), [info(forced)]).token_ids == [5]
    banned = SP(temperature=1e-4, seed=9, min_tokens=3, stop_token_ids=(best,))
    assert sampler.sample(logits.clone(), [info(banned)]).token_ids != [best]
    penalised = SP(temperature=1e-4, seed=9, repetition_penalty=1e6)
    assert sampler.sample(logits.clone(), [info(penalised, prompt=[best])]).token_ids != [best]
    # the same slot again, none of that left behind
    assert sampler.sample(logits.clone(), [info(cold)]).token_ids == [best]


def test_kept_state_grows_and_wide_calls_work():
    sampler, v = Sampler(seed=3), 50
    for n in (1, 3, 70, 2):  # 70 rows: above the kept capacity, built for the call
        logits = logits_for(n, v, seed=n)
        out = sampler.sample(logits, [info(SP(temperature=1e-4, seed=i)) for i in range(n)])
        assert out.token_ids == logits.argmax(-1).tolist()


def _mixed(n: int) -> list[SeqSamplingInfo]:
    kinds = [
        SP(temperature=0.8, seed=11),
        SP(temperature=1.0, seed=12, top_k=40, top_p=0.9),
        SP(temperature=0.0),
        SP(temperature=0.7, seed=13, logprobs=5),
        SP(temperature=0.9, seed=14, repetition_penalty=1.3, min_p=0.05),
        SP(temperature=0.6, seed=15, min_tokens=2, stop_token_ids=(7,), logit_bias=((9, 2.0),)),
    ]
    return [info(kinds[i % len(kinds)], prompt=[i, i + 1, 9], output=[]) for i in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 17, GRAPH_ROWS, GRAPH_ROWS + 5])
def test_graph_replay_matches_eager_on_cuda(n):
    dev, v = torch.device("cuda"), 32000
    eager, graphed = Sampler(seed=1, eos_token_ids=(2,)), Sampler(seed=1, eos_token_ids=(2,))
    graphed.capture_graphs(v, dev)
    try:
        for seed in range(3):
            logits = logits_for(n, v, seed=100 + seed, device=dev)
            for seqs in (_mixed(n), [info(SP(temperature=1.0, seed=5 + i)) for i in range(n)]):
                a = eager.sample(logits.clone(), seqs)
                b = graphed.sample(logits.clone(), seqs)
                assert a.token_ids == b.token_ids
                assert a.logprobs == b.logprobs
    finally:
        graphed.release_graphs()
