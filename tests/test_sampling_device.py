"""The device sampler: the Triton kernel (under TRITON_INTERPRET=1 here) against its torch twin,
logits processing against a plain reference, exact filtered distributions over 100k seeded
draws (chi-square, fixed seeds: the test cannot flake), and the state slots' step / counts."""

from __future__ import annotations

import math
import random

import pytest
import torch

from splitserve.engine.sampling_state import LogprobBuffers, RowInit, SamplingState, sample_step
from splitserve.kernels.dispatch import force_triton
from splitserve.request.sampling_params import SamplingParams as SP

EOS = (0,)


def run(
    logits,
    params,
    prompt=(1, 2, 3),
    outputs=None,
    triton=False,
    seeds=None,
    steps=None,
    x=None,
    filters=True,
):
    n, vocab = logits.shape
    outputs = outputs or [[4, 5]] * n
    rows = [
        RowInit(
            p,
            list(prompt),
            list(outputs[i]),
            seeds[i] if seeds else (p.seed if p.seed is not None else 11),
            steps[i] if steps else len(outputs[i]),
        )
        for i, p in enumerate(params)
    ]
    state = SamplingState.from_rows(rows, vocab, EOS, logits.device)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    lp = None if x is not None else LogprobBuffers.empty(n, vocab, logits.device)
    slots = torch.arange(n, device=logits.device)
    x = logits.clone() if x is None else x  # without logprobs, x ends up processed in place
    with force_triton(triton):
        sample_step(x, slots, torch.ones_like(slots), state, out, lp, filters)
    return out.tolist(), state, lp


MIXED = [
    SP(temperature=0),
    SP(),
    SP(temperature=0.7, top_p=0.9),
    SP(top_k=5, seed=3),
    SP(min_p=0.2),
    SP(top_k=7, top_p=0.5, min_p=0.01, temperature=1.3),
    SP(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, seed=1),
    SP(temperature=0, repetition_penalty=2.0),
    SP(logit_bias={3: 100}),
    SP(min_tokens=3, max_tokens=5, seed=9, top_k=2),
    SP(logprobs=5, seed=2, top_p=0.3),
    SP(top_k=1000, top_p=0.999, temperature=3.0),
]


@pytest.mark.parametrize("seed", range(3))
def test_triton_kernel_matches_torch_twin(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(MIXED), 520, generator=g) * 3  # 520: two chunks per row
    logits[:, 40:44] = logits[:, 40:41]  # ties
    want, _, _ = run(logits, MIXED, seeds=list(range(50, 62)))
    got, _, _ = run(logits, MIXED, seeds=list(range(50, 62)), triton=True)
    assert got == want


UNFILTERED = [  # no top-k / top-p: the steps that skip the threshold searches (filters=False)
    SP(temperature=0),
    SP(),
    SP(temperature=0.7, seed=5),
    SP(min_p=0.2, temperature=1.5),
    SP(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, seed=1),
    SP(logit_bias={3: 100}, temperature=0.5),
    SP(min_tokens=3, max_tokens=5, seed=9),
    SP(logprobs=5, seed=2),
    SP(temperature=0, repetition_penalty=2.0, logprobs=1),
]


@pytest.mark.parametrize("seed", range(3))
def test_unfiltered_step_matches_torch_twin(seed):
    """filters=False (what every variant without FILTER runs: temperature, min-p, penalties,
    bias, bans, logprobs) gives the twin's tokens, counts and raw logprobs."""
    g = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(len(UNFILTERED), 9000, generator=g) * 3  # three 4096-token chunks
    logits[:, 40:44] = logits[:, 40:41]  # ties
    seeds = list(range(70, 70 + len(UNFILTERED)))
    want, want_state, want_lp = run(logits, UNFILTERED, seeds=seeds, filters=False)
    got, got_state, got_lp = run(logits, UNFILTERED, seeds=seeds, triton=True, filters=False)
    assert got == want
    assert torch.equal(got_state.counts, want_state.counts)
    assert torch.equal(got_state.step, want_state.step)
    asked = [7, 8]
    assert torch.allclose(got_lp.sampled[asked], want_lp.sampled[asked], atol=1e-5)
    assert torch.allclose(got_lp.top[asked], want_lp.top[asked], atol=1e-5)
    for r in asked:  # the twin's topk orders the tied ids 40..43 freely: compare by raw value
        assert torch.equal(logits[r, got_lp.top_ids[r]], logits[r, want_lp.top_ids[r]])


LOGPROB_ROWS = [
    SP(logprobs=5, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
    SP(logprobs=3, logit_bias={7: 50.0, 5000: -20.0}, temperature=0),
    SP(logprobs=2, min_tokens=3, max_tokens=9, top_k=4),
    SP(logprobs=0, top_p=0.5, seed=4),
    SP(temperature=0, logit_bias={1: 9.0}),  # asks for none: left as it is
]


@pytest.mark.parametrize("seed", range(2))
def test_step_logprobs_are_raw_although_the_sampler_changed_the_logits(seed):
    """Penalties, bias and bans change chunks in place: the device logprobs (stats taken in the
    first pass, changed chunks read from the side buffer) still equal the twin's raw ones."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(LOGPROB_ROWS), 9000, generator=g) * 2  # three 4096-token chunks
    outputs = [[7, 7, 5000, 4100], [7], [0, 1], [3], [1]]
    want, _, want_lp = run(logits, LOGPROB_ROWS, outputs=outputs)
    got, _, got_lp = run(logits, LOGPROB_ROWS, outputs=outputs, triton=True)
    assert got == want
    asked = [0, 1, 2, 3]
    assert torch.allclose(got_lp.sampled[asked], want_lp.sampled[asked], atol=1e-5)
    assert torch.allclose(got_lp.top[asked], want_lp.top[asked], atol=1e-5)
    assert got_lp.top_ids[asked].tolist() == want_lp.top_ids[asked].tolist()
    assert got_lp.top_ids[4].abs().sum() == 0  # zeros as allocated: not computed


def reference_processed(x: list[float], p: SP, prompt, output, step) -> list[float]:
    """Plain Python: bias, min_tokens bans, repetition, frequency, presence (vLLM's order)."""
    x = list(x)
    for t, b in p.logit_bias:
        x[t] += b
    if step < p.min_tokens:
        for t in {*(() if p.ignore_eos else EOS), *p.stop_token_ids}:
            x[t] = -math.inf
    counts = {t: output.count(t) for t in set(output)}
    for t in range(len(x)):
        if t in counts or t in prompt:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = counts.get(t, 0)
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return x


@pytest.mark.parametrize("triton", [False, True])
def test_processed_logits_equal_plain_reference(triton):
    """The processed logits (bias, min_tokens bans, penalties; left in place by the step when
    no logprobs are asked) equal the plain reference value by value, and the greedy pick is
    their argmax."""
    rng = random.Random(5)
    vocab = 40
    for _ in range(12):
        out = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        bias = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(0, 4))}
        p = SP(
            temperature=0,
            repetition_penalty=rng.choice([1.0, 0.7, 1.8]),
            frequency_penalty=rng.uniform(-2, 2),
            presence_penalty=rng.uniform(-2, 2),
            logit_bias=bias,
            min_tokens=rng.choice([0, 10]),
            max_tokens=16,
            stop_token_ids=(rng.randrange(vocab),),
        )
        x = torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(99))) * 4
        want = reference_processed(x.tolist(), p, prompt, out, len(out))
        best = max(range(vocab), key=lambda t: (want[t], -t))
        processed = x.unsqueeze(0).clone()
        got, _, _ = run(x.unsqueeze(0), [p], prompt, [out], triton=triton, x=processed)
        assert got == [best]
        assert processed[0].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)


def exact_distribution(raw: list[float], p: SP) -> list[float]:
    """The filtered, renormalised distribution by the written rules (sorting, plain Python)."""
    z = [(v - max(raw)) / p.temperature for v in raw]
    keep = [True] * len(z)
    if p.min_p > 0:
        keep = [k and v >= math.log(p.min_p) for k, v in zip(keep, z)]
    if 0 < p.top_k < len(z):
        kth = sorted(z, reverse=True)[p.top_k - 1]
        keep = [k and v >= kth for k, v in zip(keep, z)]
    e = [math.exp(v) if k else 0.0 for v, k in zip(z, keep)]
    if p.top_p < 1:
        total = sum(e)
        keep = [k and sum(o for o in e if o > mine) < p.top_p * total for k, mine in zip(keep, e)]
        e = [v if k else 0.0 for v, k in zip(e, keep)]
    total = sum(e)
    return [v / total for v in e]


FILTERS = {
    "temperature": SP(temperature=0.6),
    "top_k": SP(top_k=4),
    "top_p": SP(top_p=0.8),
    "min_p": SP(min_p=0.15),
    "top_k+top_p": SP(top_k=6, top_p=0.7, temperature=1.4),
    "all": SP(top_k=5, top_p=0.9, min_p=0.05, temperature=0.8),
}


@pytest.mark.parametrize("name", list(FILTERS))
def test_filtered_distribution_over_100k_seeded_draws(name):
    """df <= 11: the chi-square 99.99th percentile is below 40; a wrong cut or a biased race
    lands far above. Seeds are fixed, so the statistic is the same on every run."""
    raw = [1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 1.5, 0.7, -2.0, 0.9, 0.1]
    p = FILTERS[name]
    n = 100_000
    logits = torch.tensor(raw).expand(n, -1).contiguous()
    tokens, _, _ = run(logits, [p] * n, outputs=[[]] * n, seeds=list(range(n)))
    probs = exact_distribution(raw, p)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(raw)).tolist()
    assert all(c == 0 for c, q in zip(counts, probs) if q == 0)  # never a filtered token
    chi = sum((c - q * n) ** 2 / (q * n) for c, q in zip(counts, probs) if q > 0)
    assert chi < 40, (counts, [round(q * n) for q in probs])


def test_state_steps_counts_and_min_tokens_lift():
    vocab = 16
    logits = torch.zeros(1, vocab)
    logits[0, 0] = 50.0  # EOS would win every time
    p = SP(min_tokens=2, max_tokens=8, temperature=0, frequency_penalty=0.0)
    rows = [RowInit(p, [1], [], 0, 0)]
    state = SamplingState.from_rows(rows, vocab, EOS, logits.device)
    out = torch.empty(1, dtype=torch.int64)
    slots, live = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    picks = []
    for _ in range(3):
        sample_step(logits.clone(), slots, live, state, out)  # processed in place
        picks.append(out.item())
    assert picks[:2] != [0, 0] and 0 not in picks[:2] and picks[2] == 0
    assert state.step.tolist() == [3]
    assert state.counts[0].sum().item() == 3 and state.counts[0, 0].item() == 1


def test_seeded_row_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(9)
    row = torch.randn(1, 300, generator=g)
    target = SP(seed=77, temperature=0.9, top_p=0.95, top_k=40)
    for step in range(6):
        alone, _, _ = run(row, [target], steps=[step])
        others = torch.randn(7, 300, generator=g)
        batch = torch.cat([others[:3], row, others[3:]])
        params = [MIXED[i] for i in (1, 2, 6)] + [target] + [MIXED[i] for i in (0, 9, 10, 11)]
        got, _, _ = run(batch, params, steps=[step] * 8)
        assert got[3] == alone[0]
    other, _, _ = run(row.expand(64, -1).contiguous(), [target] * 64, steps=list(range(64)))
    assert len(set(other)) > 10  # the step moves the noise


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FILTERS))
def test_cuda_kernel_distribution_and_twin(name):
    raw = [1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 1.5, 0.7, -2.0, 0.9, 0.1]
    p, n = FILTERS[name], 100_000
    logits = torch.tensor(raw).expand(n, -1).contiguous().cuda()
    tokens, _, _ = run(logits, [p] * n, outputs=[[]] * n, seeds=list(range(n)))
    cpu, _, _ = run(logits[:2000].cpu(), [p] * 2000, outputs=[[]] * 2000, seeds=list(range(2000)))
    assert tokens[:2000] == cpu
    probs = exact_distribution(raw, p)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(raw)).tolist()
    chi = sum((c - q * n) ** 2 / (q * n) for c, q in zip(counts, probs) if q > 0)
    assert chi < 40 and all(c == 0 for c, q in zip(counts, probs) if q == 0)
