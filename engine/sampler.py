"""The host-facing sampler: a step's logits -> one token per sequence (+ logprobs).

It is a thin front over engine/sampling_state.py, the same code the decode graph replays: the
prefill worker's first token, the decode worker's recompute path and the offline engine build
a per-call state of n slots from the sequences' parameters and tokens and run `sample_step`,
so every path applies one set of rules (see engine/sampling_math.py for them).

Reproducibility: a seeded row's token is a function of its logits, seed and step (tokens
generated so far) only: counter-based noise, no generator state. So a prefill worker sampling
token 0 and a decode worker sampling tokens 1.. give the sequence that one process would, and
a seeded request gives the same tokens alone or in any batch as long as its logits are the
same. Logits are bit-identical across batch sizes on the fp32 path; under bf16 the kernels'
tiling can differ by batch size, so there a seeded request is reproducible run to run at the
same batch composition and otherwise "the same up to bf16 rounding" (docs/sampling.md).
Unseeded rows get a seed drawn from this sampler's generator (seeded from `seed`, or from
OS entropy when `seed` is None).
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from splitserve.engine.grammar_masks import host_masks
from splitserve.engine.sampling_state import (
    LogprobBuffers,
    RowInit,
    SamplingState,
    has_filters,
    sample_step,
)
from splitserve.request.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams


@dataclass(frozen=True, slots=True)
class SeqSamplingInfo:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far; its length is the step index
    matcher: object | None = None  # structured output: an llguidance matcher at this step

    @property
    def step(self) -> int:
        return len(self.output_token_ids)


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the sampled token, from the raw logits
    top: list[tuple[int, float]] = field(default_factory=list)  # n best (id, logprob), desc


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


class Sampler:
    def __init__(self, seed: int | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self._rng = random.Random(secrets.randbits(63) if seed is None else seed)
        self.eos_token_ids = tuple(eos_token_ids)

    def seed_for(self, params: SamplingParams) -> int:
        """The request's seed, or a fresh one from this sampler's generator."""
        return params.seed if params.seed is not None else self._rng.getrandbits(64)

    def row(self, s: SeqSamplingInfo) -> RowInit:
        return RowInit(
            s.params, s.prompt_token_ids, s.output_token_ids, self.seed_for(s.params), s.step
        )

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: Sequence[SeqSamplingInfo]) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(
                f"logits must be [batch, vocab] with batch={len(seqs)}, got {tuple(logits.shape)}"
            )
        n, vocab = logits.shape
        if all(s.params.is_plain_greedy for s in seqs):  # (a constrained row is not plain)
            tokens = logits.argmax(dim=-1)
            return SampleOutput(tokens.tolist(), [None] * n)
        dev = logits.device
        # tables as wide as the limits (as the decode worker's): one kernel specialisation for
        # any request, so no first token waits on a compilation (engine/prefill_warmup.py)
        eos = self.eos_token_ids
        state = SamplingState(n, vocab, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS + len(eos), dev)
        state.write(list(range(n)), [self.row(s) for s in seqs], eos)
        out = torch.empty(n, dtype=torch.int64, device=dev)
        want = any(s.params.logprobs is not None for s in seqs)
        lp = LogprobBuffers.empty(n, vocab, dev) if want else None
        slots = torch.arange(n, device=dev)
        filters = any(has_filters(s.params) for s in seqs)
        x = logits.to(torch.float32, copy=True)  # the caller's logits stay as they were
        matchers = [s.matcher for s in seqs]
        mask = host_masks(matchers, vocab, dev) if any(m is not None for m in matchers) else None
        sample_step(x, slots, torch.ones_like(slots), state, out, lp, filters, mask)
        return SampleOutput(out.tolist(), to_token_logprobs(out, lp, [s.params for s in seqs]))


def to_token_logprobs(
    tokens: torch.Tensor | Sequence[int],
    lp: LogprobBuffers | None,
    params: Sequence[SamplingParams],
) -> list[TokenLogprobs | None]:
    """Host lists from logprob buffers, for the rows whose params ask (n best of each)."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    if lp is None:
        return out
    n = len(params)
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    width = max(p.logprobs or 0 for p in params)  # host lists only as wide as asked
    sampled = lp.sampled[:n].tolist()
    top, top_ids = lp.top[:n, :width].tolist(), lp.top_ids[:n, :width].tolist()
    for i, p in enumerate(params):
        if p.logprobs is not None:
            best = list(zip(top_ids[i][: p.logprobs], top[i][: p.logprobs]))
            out[i] = TokenLogprobs(ids[i], sampled[i], best)
    return out
