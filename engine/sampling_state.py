"""Per-sequence sampling state on the device, and the one sampling step that reads it.

A `SamplingState` holds S state slots. A slot is one sequence's parameters (temperature,
top-k/p, min-p, penalties, seed, min_tokens, logit bias, banned ids), its step counter (tokens
generated so far) and its penalty state: output-token counts and a prompt-token mask, both
[S, V], updated by the step itself. The decode worker keeps one state of max_batch + 1 slots
for its whole life (the last slot: plain greedy, for greedy rows and padding lanes) and fills
a slot once per admitted sequence (`write`); a step only says which slot each row uses. The
host sampler (engine/sampler.py: a prompt's first token, recompute) keeps a state between
calls, and its graphs one of their own (engine/sampler_graphs.py); `from_rows` builds one for a
single call (tests, benchmarks).

`sample_step` is the whole sampling of one step: on CUDA a fixed number of Triton launches
(kernels/triton_sampling.py), elsewhere the torch twin, so it runs inside a captured graph:
structured-output token masks (when given: kernels/token_bitmask.py), bias and bans, penalties,
filters, the seeded race, then step += live and counts += the token, and raw logprobs when asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine import sampling_math as sm
from splitserve.kernels.dispatch import use_triton
from splitserve.kernels.token_bitmask import apply_token_bitmask_
from splitserve.request.sampling_params import MAX_LOGPROBS, SamplingParams

FLOAT_FIELDS = ("temperature", "top_p", "min_p", "rep", "freq", "pres")
INT_FIELDS = ("top_k", "has_pen", "seed", "step", "min_tokens", "wants_logprobs")


def has_filters(p: SamplingParams) -> bool:
    """A random row with top-k or top-p: its step needs the threshold searches."""
    return not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0)


@dataclass(frozen=True, slots=True)
class RowInit:
    """What a slot is filled from: the request, its tokens so far and its resolved seed."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    seed: int  # the request's seed, or one drawn for it by the sampler (uint64)
    step: int  # tokens generated before the next sample


def _as_int64(seed: int) -> int:
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _put(values, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    return (t.pin_memory() if dev.type == "cuda" else t).to(dev, non_blocking=True)


# FLOAT_FIELDS of a plain greedy slot (what `reset` writes; padding columns of staged writes);
# its INT_FIELDS are all 0
GREEDY_FLOATS = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0)


def scalar_rows(rows: Sequence[RowInit], vocab: int) -> tuple[list[list], list[list]]:
    """The slots' scalar fields from `rows`: floats in FLOAT_FIELDS order, ints in
    INT_FIELDS order, one list per field."""
    ps = [r.params for r in rows]
    floats = [
        [0.0 if p.is_greedy else max(p.temperature, sm.TINY) for p in ps],
        [p.top_p for p in ps],
        [p.min_p for p in ps],
        [p.repetition_penalty for p in ps],
        [p.frequency_penalty for p in ps],
        [p.presence_penalty for p in ps],
    ]
    ints = [
        # 0 = off; any k >= V keeps everything (and an int32 cannot hold every uint32 k)
        [p.top_k if 0 < p.top_k < vocab else 0 for p in ps],
        [int(p.needs_penalties) for p in ps],
        [_as_int64(r.seed) for r in rows],
        [r.step for r in rows],
        [p.min_tokens for p in ps],
        [int(p.logprobs is not None) for p in ps],
    ]
    return floats, ints


def bias_rows(
    ps: Sequence[SamplingParams], eos: Sequence[int], width: int, ban_width: int
) -> tuple[list[list[int]], list[list[float]]] | None:
    """Per row: bias ids then banned ids ([width + ban_width], 0 / -1 padded), and bias values
    ([width]); None when no row has a bias or a ban (min_tokens bans EOS and stop ids)."""
    bans_of = [
        sorted({*(() if p.ignore_eos else eos), *p.stop_token_ids}) if p.min_tokens else []
        for p in ps
    ]
    if not any(p.logit_bias for p in ps) and not any(bans_of):
        return None
    ids, vals = [], []
    for p, bans in zip(ps, bans_of):
        bias_ids = [t for t, _ in p.logit_bias] + [0] * (width - len(p.logit_bias))
        vals.append([v for _, v in p.logit_bias] + [0.0] * (width - len(p.logit_bias)))
        ids.append(bias_ids + bans + [-1] * (ban_width - len(bans)))
    return ids, vals


class SamplingState:
    def __init__(
        self, slots: int, vocab: int, bias_width: int, ban_width: int, device: torch.device
    ) -> None:
        f32, i32, i64 = torch.float32, torch.int32, torch.int64
        self.num_slots, self.vocab, self.device = slots, vocab, device
        self.frozen_slot = -1  # a slot the step never advances (the decode worker's greedy slot)
        z = lambda dt, *shape: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        self.temperature, self.top_p, self.min_p = z(f32, slots), z(f32, slots), z(f32, slots)
        self.rep, self.freq, self.pres = z(f32, slots), z(f32, slots), z(f32, slots)
        self.top_k, self.has_pen = z(i32, slots), z(i32, slots)
        self.wants_logprobs = z(i32, slots)  # the device logprobs skip the other rows
        self.seed, self.step, self.min_tokens = z(i64, slots), z(i64, slots), z(i64, slots)
        self.counts = z(i32, slots, vocab)
        self.prompt_seen = z(torch.uint8, slots, vocab)
        self.bias_ids, self.bias_vals = z(i32, slots, bias_width), z(f32, slots, bias_width)
        self.ban_ids = torch.full((slots, ban_width), -1, dtype=i32, device=device)
        self.reset()

    def reset(self) -> None:
        """Every slot plain greedy (what capture runs on, and what the greedy slot stays)."""
        for name, value in zip(FLOAT_FIELDS, GREEDY_FLOATS):
            getattr(self, name).fill_(value)
        for name in INT_FIELDS:
            getattr(self, name).zero_()
        for t in (self.counts, self.prompt_seen, self.bias_ids, self.bias_vals):
            t.zero_()
        self.ban_ids.fill_(-1)

    # ---- filling slots (host -> device, once per sequence) --------------------------------
    def write(self, slots: Sequence[int], rows: Sequence[RowInit], eos: Sequence[int]) -> None:
        """Fills `slots` from `rows`: stream-ordered after any step still using them. Every
        scalar field travels in one pinned copy per dtype and bias / bans only when a row has
        them (a first token of a sampled request waits on this: it was 13 copies and 1.7 ms)."""
        if not slots:
            return
        floats, ints = scalar_rows(rows, self.vocab)
        f_dev = _put(floats, torch.float32, self.device)
        i_dev = _put([*ints, list(slots)], torch.int64, self.device)
        idx = i_dev[-1]
        for name, vals in zip(FLOAT_FIELDS, f_dev):
            getattr(self, name).index_copy_(0, idx, vals)
        for name, vals in zip(INT_FIELDS, i_dev):
            t = getattr(self, name)
            t.index_copy_(0, idx, vals.to(t.dtype))
        width, ban_w = self.bias_ids.shape[1], self.ban_ids.shape[1]
        lists = bias_rows([r.params for r in rows], eos, width, ban_w)
        if lists is None:  # no row has any: cleared on the device
            self.bias_ids.index_fill_(0, idx, 0)
            self.bias_vals.index_fill_(0, idx, 0.0)
            self.ban_ids.index_fill_(0, idx, -1)
        else:
            ids, vals = (
                _put(lists[0], torch.int32, self.device),
                _put(lists[1], torch.float32, self.device),
            )
            self.bias_ids.index_copy_(0, idx, ids[:, :width])
            self.bias_vals.index_copy_(0, idx, vals)
            self.ban_ids.index_copy_(0, idx, ids[:, width:])
        self.counts.index_fill_(0, idx, 0)
        self.prompt_seen.index_fill_(0, idx, 0)
        self.write_penalty_tokens(slots, rows)

    def write_penalty_tokens(self, slots: Sequence[int], rows: Sequence[RowInit]) -> None:
        """Output-token counts and the prompt mask of the penalised rows' slots (zeroed before)."""
        pen = [(s, r) for s, r in zip(slots, rows) if r.params.needs_penalties]
        if not pen:  # ids outside the vocabulary (a larger tokenizer's prompt) have no logit
            return
        out = [(s, t) for s, r in pen for t in r.output_token_ids if 0 <= t < self.vocab]
        seen = [(s, t) for s, r in pen for t in r.prompt_token_ids if 0 <= t < self.vocab]
        if out:
            cell = _put(out, torch.int64, self.device)
            ones = torch.ones(len(out), dtype=torch.int32, device=self.device)
            self.counts.index_put_((cell[:, 0], cell[:, 1]), ones, accumulate=True)
        if seen:
            cell = _put(seen, torch.int64, self.device)
            self.prompt_seen[cell[:, 0], cell[:, 1]] = 1

    @classmethod
    def from_rows(
        cls, rows: Sequence[RowInit], vocab: int, eos: Sequence[int], device: torch.device
    ) -> SamplingState:
        """A state of len(rows) slots, row i in slot i (the eager paths)."""
        bias = max([len(r.params.logit_bias) for r in rows] + [1])
        ban = max([len(r.params.stop_token_ids) + len(eos) for r in rows] + [1])
        state = cls(len(rows), vocab, bias, ban, device)
        state.write(list(range(len(rows))), rows, eos)
        return state


@dataclass
class LogprobBuffers:
    """Outputs of a step that reports logprobs: [n] sampled, [n, 20] top values and ids."""

    sampled: torch.Tensor
    top: torch.Tensor
    top_ids: torch.Tensor

    @classmethod
    def empty(cls, rows: int, vocab: int, device: torch.device) -> LogprobBuffers:
        f32, width = torch.float32, min(MAX_LOGPROBS, vocab)
        return cls(
            torch.zeros(rows, dtype=f32, device=device),
            torch.zeros(rows, width, dtype=f32, device=device),
            torch.zeros(rows, width, dtype=torch.int64, device=device),
        )


def sample_step(
    logits: torch.Tensor,
    slots: torch.Tensor,
    live: torch.Tensor,
    state: SamplingState,
    out: torch.Tensor,
    logprobs: LogprobBuffers | None = None,
    filters: bool = True,
    token_mask: torch.Tensor | None = None,
) -> None:
    """out[:n] = the tokens of fp32 logits [n, V] whose rows use state slots `slots` [n]
    (`logits` is overwritten with the processed values; with `logprobs`, raw logprobs of the
    rows whose slot asked: on CUDA the sampler's first pass saves any chunk it changes of those
    rows, elsewhere, or with a token mask, the raw logits are copied first); `live` [n]
    (int64, 0 for padding lanes) advances the slots' steps and counts. filters=False promises
    that no row has top-k / top-p (the GPU skips their searches). `token_mask` [n, ceil(V /
    32)] int32 (structured output): tokens whose bit is 0 get -inf before anything else;
    logprobs stay those of the raw logits."""
    n = logits.shape[0]
    tokens = out[:n]
    masked_raw = token_mask is not None and logprobs is not None
    # raw logits kept by a copy where the kernels' side buffer cannot serve (CPU, or a mask)
    copy_raw = logprobs is not None and (masked_raw or not use_triton(logits))
    x = logits.clone() if copy_raw else logits
    if token_mask is not None:
        apply_token_bitmask_(x, token_mask)
    if not use_triton(x):
        _sample_torch(x, slots, live, state, tokens)
        if logprobs is not None:
            sampled, top, ids = sm.raw_logprobs(logits, tokens, MAX_LOGPROBS)
            logprobs.sampled[:n].copy_(sampled)
            logprobs.top[:n].copy_(top)
            logprobs.top_ids[:n].copy_(ids)
        return
    # bias, bans, penalties, race and the slots' step / counts: in-kernel
    from splitserve.kernels import triton_logprobs as tlp
    from splitserve.kernels.triton_sampling import sample_rows, split_of

    lp = None
    if logprobs is not None and not masked_raw:  # raw stats in the first pass, no copy
        chunk, sub = split_of(logits.shape[1])
        width = logprobs.top.shape[1]
        lp = tlp.LogprobScratch.empty(n, logits.shape[1], width, logits.device, True, chunk, sub)
    sample_rows(x, slots, live, tokens, state, state.frozen_slot, filters, lp=lp)
    if logprobs is None:
        return
    lpb = logprobs
    outs = (tokens, lpb.sampled[:n], lpb.top[:n], lpb.top_ids[:n], slots, state.wants_logprobs)
    if lp is not None:
        tlp.top_pass(logits, *outs, lp, side=True)
    else:  # x is a masked copy: the logits themselves are raw
        tlp.raw_logprobs_device(logits, *outs)


def _sample_torch(
    x: torch.Tensor, slots: torch.Tensor, live: torch.Tensor, state: SamplingState, tokens
) -> None:
    """The torch twin of kernels/triton_sampling.py: the same tokens, with sorts."""
    g = lambda t: t.index_select(0, slots)  # noqa: E731
    ban_on = g(state.step) < g(state.min_tokens)
    sm.add_bias_and_bans(x, g(state.bias_ids), g(state.bias_vals), g(state.ban_ids), ban_on)
    pen = g(state.has_pen).bool().unsqueeze(1)
    penalised = sm.apply_penalties(
        x, g(state.counts), g(state.prompt_seen), g(state.rep), g(state.freq), g(state.pres)
    )
    x.copy_(torch.where(pen, penalised, x))  # in place, as the kernel does
    tokens.copy_(
        sm.sample_rows_torch(
            x,
            g(state.temperature),
            g(state.top_k),
            g(state.top_p),
            g(state.min_p),
            g(state.seed),
            g(state.step),
        )
    )
    if state.frozen_slot >= 0:  # greedy rows and padding lanes leave the greedy slot as it is
        live = live * (slots != state.frozen_slot)
    state.step.index_add_(0, slots, live)
    state.counts.index_put_((slots, tokens), live.to(torch.int32), accumulate=True)
