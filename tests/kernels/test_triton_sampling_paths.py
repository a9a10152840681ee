"""Every path of the device sampler (kernels/triton_sampling*.py, under TRITON_INTERPRET=1 here)
gives the torch twin's token: top-k by radix select (ties at the k-th kept), top-p rows decided
by the race rounds or left to the exact loop, min-p, greedy, penalised, biased and banned rows,
several chunks per row, peaked and flat rows."""

from __future__ import annotations

import random

import pytest
import torch

import splitserve.kernels.triton_sampling as ts
from splitserve.engine.sampling_state import RowInit, SamplingState, sample_step
from splitserve.kernels.dispatch import force_triton
from splitserve.request.sampling_params import SamplingParams as SP

EOS = (0,)
VOCAB = 300


def random_params(rng: random.Random) -> SP:
    kind = rng.randrange(7)
    t = rng.choice([0.5, 1.0, 2.0])
    if kind == 0:
        return SP(temperature=0, repetition_penalty=rng.choice([1.0, 1.5]))
    if kind == 1:
        return SP(temperature=t, top_k=rng.choice([1, 2, 3, 4, 7, 40, 299, 500]))
    if kind == 2:
        return SP(temperature=t, top_p=rng.choice([0.05, 0.3, 0.6, 0.9, 0.99]))
    if kind == 3:
        return SP(temperature=t, top_k=rng.choice([3, 9, 60]), top_p=rng.choice([0.2, 0.8]))
    if kind == 4:
        return SP(temperature=t, min_p=rng.choice([0.01, 0.3]), top_p=rng.choice([1.0, 0.5]))
    if kind == 5:
        return SP(
            temperature=t,
            frequency_penalty=0.5,
            logit_bias={rng.randrange(VOCAB): 5.0},
            min_tokens=4,
            max_tokens=8,
            top_k=rng.choice([0, 3]),
        )
    return SP(temperature=t)


def rows_for(params, rng):
    out = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 4))] for _ in params]
    return [RowInit(p, [1, 2, 3], o, rng.getrandbits(64), len(o)) for p, o in zip(params, out)]


def logits_for(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.05, 0.5, 3.0])[torch.randint(0, 3, (n, 1), generator=g)]
    x = torch.randn(n, VOCAB, generator=g) * scale  # flat rows reject often, peaked rarely
    x[: n // 3, 100:108] = x[: n // 3, 100:101]  # ties
    return x


@pytest.mark.parametrize(
    "chunk,cap,rounds",
    [(64, 64, (True,)), (128, 128, (True, False)), (512, 64, None), (128, 8, (True, True))],
)
def test_every_path_gives_the_twin_token(chunk, cap, rounds, monkeypatch):
    """chunk 64: one 64-token sub-block per chunk, so top_k > 5 takes the radix select; cap 8:
    most top-k compactions overflow into it too; fewer race rounds leave more top-p rows to the
    exact loop. (Small caps keep the interpreter quick.)"""
    monkeypatch.setattr(ts, "CAP", cap)
    if rounds:
        monkeypatch.setattr(ts, "RACE_ROUNDS", rounds)
    rng = random.Random(chunk + cap)
    for trial in range(4):
        params = [random_params(rng) for _ in range(24)]
        rows = rows_for(params, rng)
        logits = logits_for(len(params), trial)
        n = len(params)
        slots, live = torch.arange(n), torch.ones(n, dtype=torch.int64)
        twin_state = SamplingState.from_rows(rows, VOCAB, EOS, logits.device)
        want = torch.empty(n, dtype=torch.int64)
        with force_triton(False):
            sample_step(logits.clone(), slots, live, twin_state, want)
        state = SamplingState.from_rows(rows, VOCAB, EOS, logits.device)
        got = torch.full((n,), -1, dtype=torch.int64)
        with force_triton(True):
            ts.sample_rows(logits.clone(), slots, live, got, state, -1, True, chunk=chunk)
        assert got.tolist() == want.tolist(), [str(p) for p in params]
        assert torch.equal(state.step, twin_state.step)
        assert torch.equal(state.counts, twin_state.counts)


def test_frozen_slot_and_padding_lanes_do_not_advance():
    params = [SP(temperature=1.0, top_p=0.5), SP(temperature=0)]
    rows = rows_for(params, random.Random(1))
    state = SamplingState.from_rows(rows, VOCAB, EOS, torch.device("cpu"))
    state.frozen_slot = 1
    before = state.step.clone()
    out = torch.empty(3, dtype=torch.int64)
    slots = torch.tensor([0, 1, 1])
    live = torch.tensor([1, 1, 0])
    with force_triton(True):
        ts.sample_rows(logits_for(3, 5), slots, live, out, state, 1, True, chunk=128)
    assert state.step.tolist() == [before[0].item() + 1, before[1].item()]
    assert state.counts[1].sum().item() == 0 and state.counts[0, out[0]].item() >= 1


def test_top_k_keeps_every_token_tied_at_the_k_th_across_chunks(monkeypatch):
    """Three tokens tie at the k-th value, two chunks apart: all three stay in the race."""
    monkeypatch.setattr(ts, "CAP", 16)
    n = 40
    x = torch.full((n, VOCAB), -4.0)
    x[:, [5, 70, 200]] = 2.0
    x[:, 64] = 2.5
    params = [SP(temperature=1.0, top_k=2)] * n
    rows = [RowInit(p, [1], [], seed, 0) for seed, p in enumerate(params)]
    slots, live = torch.arange(n), torch.ones(n, dtype=torch.int64)
    want = torch.empty(n, dtype=torch.int64)
    twin = SamplingState.from_rows(rows, VOCAB, EOS, x.device)
    with force_triton(False):
        sample_step(x.clone(), slots, live, twin, want)
    got = torch.empty(n, dtype=torch.int64)
    state = SamplingState.from_rows(rows, VOCAB, EOS, x.device)
    with force_triton(True):
        ts.sample_rows(x.clone(), slots, live, got, state, -1, True, chunk=64)
    assert got.tolist() == want.tolist()
    assert {5, 64, 70, 200} == set(got.tolist())
