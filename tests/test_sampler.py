"""Sampler (the host front of the device sampler): greedy paths, filters, penalties (exact
numbers), logprobs, seeded reproducibility independent of batch / sampler instance, and the
sampled distribution. tests/test_sampling_device.py covers the kernel, the state slots and
the exact filtered distributions over 100k draws."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import sampling_math as sm
from splitserve.engine.sampler import Sampler, SeqSamplingInfo
from splitserve.engine.sampling_state import RowInit, SamplingState
from splitserve.request.sampling_params import SamplingParams as SP


def info(params: SP, output=(), prompt=(1, 2, 3)) -> SeqSamplingInfo:
    return SeqSamplingInfo(params, list(prompt), list(output))


def rand_logits(b: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


# ----------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_temperature_zero_is_argmax(dtype):
    logits = rand_logits(6, 300).to(dtype)
    before = logits.clone()
    out = Sampler(seed=1).sample(logits, [info(SP(temperature=0.0))] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [1e-3, 1e-20, 1e-45, 1e-300])
def test_tiny_temperature_is_argmax_not_nan(temperature):
    logits = rand_logits(5, 1000, seed=8)
    seqs = [info(SP(temperature=temperature, seed=i)) for i in range(5)]
    assert Sampler().sample(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy():
    logits = rand_logits(8, 500, seed=3)
    seqs = [info(SP(top_k=1, temperature=1.3, top_p=0.9, seed=s)) for s in range(8)]
    assert Sampler().sample(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_greedy_fast_path_has_no_softmax_or_copy(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the all-greedy batch must be a single argmax")

    monkeypatch.setattr(torch.Tensor, "softmax", boom)
    monkeypatch.setattr(torch.Tensor, "sort", boom)
    monkeypatch.setattr(torch.Tensor, "to", boom)
    logits = rand_logits(4, 100)
    seqs = [
        info(SP(temperature=0.0)),
        info(SP(top_k=1)),
        info(SP(temperature=0.0, seed=3)),
        info(SP(top_k=1)),
    ]
    assert Sampler().sample(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows():
    logits = rand_logits(4, 200, seed=5)
    seqs = [
        info(SP(temperature=0.0)),
        info(SP(seed=1)),
        info(SP(top_k=1, frequency_penalty=0.1)),
        info(SP()),
    ]
    out = Sampler(seed=0).sample(logits, seqs).token_ids
    assert (
        out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    )  # outputs empty: no penalty yet


# ----------------------------------------------------------------- penalties


def apply_penalties(x: torch.Tensor, seqs: list[SeqSamplingInfo]) -> None:
    """In place, through the state slots the sampler builds (the torch twin's arithmetic)."""
    rows = [RowInit(s.params, s.prompt_token_ids, s.output_token_ids, 0, s.step) for s in seqs]
    st = SamplingState.from_rows(rows, x.shape[1], (), x.device)
    pen = st.has_pen.bool().unsqueeze(1)
    out = sm.apply_penalties(x, st.counts, st.prompt_seen, st.rep, st.freq, st.pres)
    x.copy_(torch.where(pen, out, x))


def test_penalties_exact_numbers():
    raw = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]])
    p = SP(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    x = raw.clone()
    apply_penalties(x, [info(p, prompt=[0, 1], output=[2, 2, 3])])
    # 0,1: prompt only -> repetition only; 2: output twice; 3: output once; 4,5 unseen
    expected = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 2 - 0.25, -0.5 * 2 - 0.5 * 1 - 0.25, 3.0, 1.0]
    assert x[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_penalties_only_touch_their_rows_and_flip_greedy():
    raw = torch.tensor([[5.0, 4.9, 0.0], [5.0, 4.9, 0.0], [5.0, 4.9, 0.0]])
    seqs = [
        info(SP(temperature=0.0, presence_penalty=0.2), output=[0]),
        info(SP(temperature=0.0, repetition_penalty=1.1), prompt=[0]),
        info(SP(temperature=0.0), output=[0, 0]),
    ]
    x = raw.clone()
    apply_penalties(x, seqs)
    assert x[0].tolist() == pytest.approx([4.8, 4.9, 0.0]) and x[1].tolist() == pytest.approx(
        [5 / 1.1, 4.9, 0.0]
    )
    assert torch.equal(x[2], raw[2])
    assert Sampler().sample(raw, seqs).token_ids == [1, 1, 0]


def test_out_of_vocab_prompt_ids_ignored_by_penalties():
    x = torch.tensor([[1.0, 1.0]])
    apply_penalties(x, [info(SP(repetition_penalty=2.0), prompt=[1, 7])])
    assert x.tolist() == [[1.0, 0.5]]


# ----------------------------------------------------------------- filters


PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])


def crafted(n: int) -> torch.Tensor:
    """[n, 205]: PROBS over ids 0..4 (shuffled into place), 200 more ids at ~1e-9 each."""
    v = torch.full((205,), 1e-9)
    v[torch.tensor([7, 100, 3, 150, 42])] = PROBS
    return v.log().expand(n, -1).clone()


ALLOWED = {  # ids of PROBS 0.4, 0.3, 0.15, 0.1, 0.05 -> 7, 100, 3, 150, 42
    "top_k": ({"top_k": 2}, {7, 100}),
    "top_p": ({"top_p": 0.75}, {7, 100, 3}),  # mass before 0.15 is 0.7 < 0.75, before 0.1 is 0.85
    "min_p": ({"min_p": 0.3}, {7, 100, 3}),  # floor 0.12
    "all": ({"top_k": 4, "top_p": 0.8, "min_p": 0.2}, {7, 100, 3}),
    "hot": ({"temperature": 5.0, "top_k": 3}, {7, 100, 3}),
}


@pytest.mark.parametrize("case", list(ALLOWED))
@pytest.mark.parametrize("seeded", [False, True])
def test_filters_never_pick_a_filtered_token(case, seeded):
    kwargs, allowed = ALLOWED[case]
    n = 1500 if not seeded else 300
    seqs = [info(SP(seed=s if seeded else None, **kwargs), output=[0] * (s % 3)) for s in range(n)]
    got = Sampler(seed=2).sample(crafted(n), seqs).token_ids
    assert set(got) == allowed  # nothing outside, and every allowed id seen


def test_top_k_keeps_ties_and_top_k_above_vocab():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]]).expand(400, -1).clone()
    got = Sampler(seed=0).sample(logits, [info(SP(top_k=2, temperature=10.0))] * 400).token_ids
    assert set(got) == {1, 2}
    got = Sampler(seed=0).sample(logits, [info(SP(top_k=100, temperature=50.0))] * 400).token_ids
    assert set(got) == {0, 1, 2, 3}


# ----------------------------------------------------------------- seeds


def test_seeded_reproducible_across_calls_batches_and_order():
    v = 64
    logits = rand_logits(3, v, seed=11, scale=1.0)
    target = lambda s: info(SP(seed=s, temperature=0.9, top_p=0.95), output=[5] * (s % 4))  # noqa: E731
    others = [
        info(SP()),
        info(SP(temperature=0.0, repetition_penalty=1.3)),
        info(SP(seed=999, top_k=5)),
    ]
    for s in range(25):
        alone = Sampler(seed=1).sample(logits[:1], [target(s)]).token_ids[0]
        again = Sampler(seed=2).sample(logits[:1], [target(s)]).token_ids[0]
        batch = torch.cat([logits[1:2], logits[:1], logits[2:3], logits[:1]])
        rows = [others[0], target(s), others[2], others[1]]
        in_batch = Sampler(seed=3).sample(batch, rows).token_ids[1]
        reordered = (
            Sampler()
            .sample(torch.cat([logits[:1], logits[1:3]]), [target(s), *others[:2]])
            .token_ids[0]
        )
        assert alone == again == in_batch == reordered


def test_split_generation_matches_one_process():
    """Token 0 on a 'prefill' sampler, the rest on a 'decode' sampler == all on one."""
    steps = [rand_logits(1, 97, seed=100 + t, scale=0.5) for t in range(8)]
    p = SP(seed=1234, temperature=1.0)

    def run(samplers):
        out: list[int] = []
        for t, logits in enumerate(steps):
            out.append(samplers[t].sample(logits, [info(p, output=list(out))]).token_ids[0])
        return out

    one = Sampler(seed=0)
    assert run([one] * 8) == run([Sampler(seed=5)] + [Sampler(seed=6)] * 7)


def test_different_seeds_and_steps_differ():
    logits = torch.zeros(1, 1000)  # uniform: the noise alone decides
    seq = lambda s, t: Sampler().sample(logits, [info(SP(seed=s), output=[0] * t)]).token_ids[0]  # noqa: E731
    a, b = [seq(1, t) for t in range(4)], [seq(2, t) for t in range(4)]
    assert a != b
    assert len(set(a)) > 1  # the step index changes the noise
    assert seq(1, 0) != seq(1 + 2**32, 0)  # high seed bits matter
    assert seq(2**64 - 1, 0) != seq(2**63 - 1, 0)  # the top bit too (stored as int64)


def test_unseeded_rows_vary_and_sampler_seed_reproduces():
    logits = torch.zeros(4, 1000)
    seqs = [info(SP())] * 4
    s1, s2 = Sampler(seed=7), Sampler(seed=7)
    a, b = s1.sample(logits, seqs).token_ids, s1.sample(logits, seqs).token_ids
    assert a != b and s2.sample(logits, seqs).token_ids == a


# ----------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_sorted():
    logits = rand_logits(4, 50, seed=9)
    seqs = [
        info(SP(logprobs=5, temperature=0.5, repetition_penalty=1.5, seed=1), output=[3, 4]),
        info(SP()),
        info(SP(logprobs=0, temperature=0.0)),
        info(SP(logprobs=20, top_k=3, seed=2)),
    ]
    out = Sampler().sample(logits.to(torch.bfloat16), seqs)
    ref = torch.log_softmax(logits.to(torch.bfloat16).float(), -1)
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        lp = out.logprobs[i]
        n = seqs[i].params.logprobs
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-6)
        assert len(lp.top) == n
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        assert vals == pytest.approx(ref[i].topk(n).values.tolist(), abs=1e-6)  # the n best...
        assert all(ref[i, t].item() == pytest.approx(v, abs=1e-6) for t, v in lp.top)  # ...by id
        assert len({t for t, _ in lp.top}) == n


# ----------------------------------------------------------------- distribution


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    return float(((observed - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    ("kwargs", "n"), [({}, 20000), ({"temperature": 0.7}, 20000), ({"seed": "row"}, 4000)]
)
def test_distribution_matches_softmax(kwargs, n):
    """8 categories, df 7: chi-square 99.99th percentile is ~29.9; a biased sampler
    (e.g. ignoring temperature, or noise shared across rows) lands far above it."""
    raw = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 1.5])
    temp = kwargs.get("temperature", 1.0)
    seqs = [info(SP(temperature=temp, seed=i if kwargs.get("seed") else None)) for i in range(n)]
    tokens = Sampler(seed=123).sample(raw.expand(n, -1).clone(), seqs).token_ids
    assert chi_square(tokens, torch.softmax(raw / temp, -1)) < 29.9
    if temp != 1.0:  # and it is not the untempered distribution
        assert chi_square(tokens, torch.softmax(raw, -1)) > 100


def test_filtered_distribution_is_renormalised():
    n = 20000
    seqs = [info(SP(top_k=3))] * n
    tokens = Sampler(seed=4).sample(crafted(n), seqs).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=205)[[7, 100, 3]].double()
    expected = PROBS[:3].double() / PROBS[:3].sum() * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 18.4  # df 2, p = 1e-4


@pytest.mark.gpu
def test_seeded_same_on_cuda_as_on_cpu():
    logits = rand_logits(64, 32000, seed=21)
    seqs = [
        info(
            SP(
                seed=s,
                temperature=0.8,
                top_p=0.9,
                top_k=50 * (s % 2),
                min_p=0.01 * (s % 3),
                repetition_penalty=1.2,
            ),
            output=[1] * s,
        )
        for s in range(64)
    ]
    cpu = Sampler().sample(logits, seqs).token_ids
    assert Sampler().sample(logits.cuda(), seqs).token_ids == cpu
    assert (
        Sampler().sample(logits[3:4].cuda().half(), [seqs[3]]).token_ids[0]
        == Sampler().sample(logits[3:4].half(), [seqs[3]]).token_ids[0]
    )


def test_top_k_beyond_int32_is_no_filter():
    """top_k is a uint32 on the wire: any k >= the vocabulary keeps everything (and must not
    overflow the int32 the device keeps it in)."""
    logits = rand_logits(3, 64, seed=12)
    huge = [info(SP(top_k=2**32 - 1, seed=s)) for s in range(3)]
    off = [info(SP(top_k=0, seed=s)) for s in range(3)]
    assert Sampler().sample(logits, huge).token_ids == Sampler().sample(logits, off).token_ids
