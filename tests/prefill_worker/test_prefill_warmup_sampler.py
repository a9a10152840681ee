"""The warm-up samples a constrained request's first token (engine/prefill_warmup.py): the
sampler's masked path (sampler.py: a row with a token mask never takes the sampler graphs), with
and without logprobs (on CUDA: raw_logprobs_device's stats and top pass), at every row count the
warm-up samples, with an all-allowed mask. The prefill worker and the decode worker's local
prefill share the function (decode_worker/startup.py; tests/decode_worker/
test_colocated_pool.py checks the call). And the sampler's `token_mask` stands for the
matchers' masks, even for a row that would otherwise be plain greedy. CPU, tiny model."""

from __future__ import annotations

import numpy as np
import torch
from prefill_helpers import worker_config

from splitserve.engine import sampler as sampler_mod
from splitserve.engine.grammar_masks import mask_words
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.prefill_warmup import SAMPLER_ROWS, warm_up_prefill
from splitserve.engine.sampler import Sampler, SeqSamplingInfo
from splitserve.request.sampling_params import SamplingParams


def _spy_sample_step(monkeypatch) -> list[tuple[int, torch.Tensor | None, bool]]:
    """Records (rows, token_mask, with logprobs) of every eager sampling step the sampler runs."""
    calls, real = [], sampler_mod.sample_step

    def spy(logits, slots, live, state, out, logprobs=None, filters=True, token_mask=None):
        mask = None if token_mask is None else token_mask.clone()
        calls.append((logits.shape[0], mask, logprobs is not None))
        return real(logits, slots, live, state, out, logprobs, filters, token_mask)

    monkeypatch.setattr(sampler_mod, "sample_step", spy)
    return calls


def test_warm_up_samples_constrained_first_tokens_with_and_without_logprobs(
    tiny_llama, monkeypatch
):
    runner = ModelRunner(worker_config(tiny_llama).engine)
    vocab = runner.model_config.vocab_size
    calls = _spy_sample_step(monkeypatch)
    warm_up_prefill(runner, Sampler(seed=0), 64, 8)
    every = {(n, lp) for n in SAMPLER_ROWS for lp in (False, True)}
    masked = [(n, mask, lp) for n, mask, lp in calls if mask is not None]
    assert {(n, lp) for n, _, lp in masked} == every
    for n, mask, _ in masked:  # one mask row per sampled row, every token allowed
        assert mask.shape == (n, mask_words(vocab)) and mask.dtype == torch.int32
        assert bool((mask == -1).all())
    # the unconstrained variants are still warmed, with and without logprobs
    assert {(n, lp) for n, mask, lp in calls if mask is None} == every


def _mask_banning(tokens: list[int], vocab: int) -> torch.Tensor:
    """[rows, W] int32: every token allowed but tokens[r] in row r."""
    bits = np.full((len(tokens), mask_words(vocab)), 0xFFFFFFFF, dtype=np.uint32)
    for r, t in enumerate(tokens):
        bits[r, t // 32] &= ~np.uint32(1 << (t % 32))
    return torch.from_numpy(bits.view(np.int32))


def test_a_token_mask_takes_the_masked_path_even_for_plain_greedy_rows(monkeypatch):
    vocab = 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    best = logits.argmax(-1).tolist()
    greedy = SeqSamplingInfo(SamplingParams(temperature=0.0), [0], ())
    with_lp = SeqSamplingInfo(SamplingParams(temperature=0.0, logprobs=2), [0], ())
    sampler = Sampler(seed=0)
    calls = _spy_sample_step(monkeypatch)
    allowed = torch.full((3, mask_words(vocab)), -1, dtype=torch.int32)
    assert sampler.sample(logits, [greedy] * 3, allowed).token_ids == best
    assert len(calls) == 1 and calls[0][1] is not None  # not the argmax shortcut
    second = logits.clone()
    second[torch.arange(3), best] = float("-inf")
    got = sampler.sample(logits, [greedy, with_lp, greedy], _mask_banning(best, vocab))
    assert got.token_ids == second.argmax(-1).tolist()
    raw = torch.log_softmax(logits[1], -1)  # logprobs stay those of the unmasked logits
    assert got.logprobs[1].top[0][0] == best[1]
    assert abs(got.logprobs[1].logprob - float(raw[got.token_ids[1]])) < 1e-5
    assert sampler.sample(logits, [greedy] * 3).token_ids == best  # no mask: as before
