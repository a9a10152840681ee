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
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from splitserve.engine.grammar_masks import host_masks
from splitserve.engine.sampler_graphs import SamplerGraphs
from splitserve.engine.sampling_state import (
    LogprobBuffers,
    RowInit,
    SamplingState,
    has_filters,
    sample_step,
)
from splitserve.request.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams

CACHED_ROWS = 64  # a sampler keeps its state for calls of up to this many rows ([rows, V] tables)


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


@dataclass(frozen=True, slots=True)
class _Kept:
    """The host sampler's buffers for up to `state.num_slots` rows (Sampler._buffers)."""

    vocab: int
    device: torch.device
    state: SamplingState
    out: torch.Tensor  # [rows] int64 tokens
    logprobs: LogprobBuffers
    slots: torch.Tensor  # [rows] 0..rows-1: row i uses slot i

    @classmethod
    def of(cls, rows: int, vocab: int, dev: torch.device, num_eos: int) -> _Kept:
        state = SamplingState(rows, vocab, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS + num_eos, dev)
        out = torch.empty(rows, dtype=torch.int64, device=dev)
        lp = LogprobBuffers.empty(rows, vocab, dev)
        return cls(vocab, dev, state, out, lp, torch.arange(rows, device=dev))


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


class Sampler:
    def __init__(self, seed: int | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self._rng = random.Random(secrets.randbits(63) if seed is None else seed)
        self.eos_token_ids = tuple(eos_token_ids)
        self._lock = threading.Lock()
        self._kept: _Kept | None = None
        self.graphs: SamplerGraphs | None = None

    def capture_graphs(self, vocab: int, device: torch.device, pool=None) -> None:
        """CUDA: the sampling of up to GRAPH_ROWS rows as graphs (sampler_graphs.py), into
        `pool` (the worker's one graph pool)."""
        if device.type != "cuda":
            return
        self.release_graphs()
        graphs = SamplerGraphs(vocab, device, len(self.eos_token_ids))
        graphs.capture(pool)
        self.graphs = graphs

    def release_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def _buffers(self, n: int, vocab: int, dev: torch.device) -> _Kept:
        """The sampling state and outputs of >= n rows, kept between calls: building them took
        ~15 allocations and fills per first token. Capacity grows by powers of two; tables as
        wide as the limits (as the decode worker's), so one kernel specialisation serves any
        request and no first token waits on a compilation (engine/prefill_warmup.py)."""
        k = self._kept
        if k is not None and k.state.num_slots >= n and (k.vocab, k.device) == (vocab, dev):
            return k
        k = _Kept.of(1 << max(0, n - 1).bit_length(), vocab, dev, len(self.eos_token_ids))
        if k.state.num_slots <= CACHED_ROWS:  # rare wide calls: [rows, V] tables not kept
            self._kept = k
        return k

    def seed_for(self, params: SamplingParams) -> int:
        """The request's seed, or a fresh one from this sampler's generator."""
        return params.seed if params.seed is not None else self._rng.getrandbits(64)

    def row(self, s: SeqSamplingInfo) -> RowInit:
        return RowInit(
            s.params, s.prompt_token_ids, s.output_token_ids, self.seed_for(s.params), s.step
        )

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SeqSamplingInfo],
        token_mask: torch.Tensor | None = None,
    ) -> SampleOutput:
        """`token_mask` [n, ceil(V / 32)] int32, when given, stands for the matchers' masks (the
        warm-up's all-allowed mask: engine/prefill_warmup.py); the call takes the constrained
        rows' path."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(
                f"logits must be [batch, vocab] with batch={len(seqs)}, got {tuple(logits.shape)}"
            )
        n, vocab = logits.shape
        plain = all(s.params.is_plain_greedy for s in seqs)  # (a constrained row is not plain)
        if plain and token_mask is None:
            tokens = logits.argmax(dim=-1)
            return SampleOutput(tokens.tolist(), [None] * n)
        dev = logits.device
        rows = [self.row(s) for s in seqs]
        params = [s.params for s in seqs]
        want = any(p.logprobs is not None for p in params)
        filters = any(has_filters(p) for p in params)
        matchers = [s.matcher for s in seqs]
        constrained = token_mask is not None or any(m is not None for m in matchers)
        with self._lock:  # cached buffers (their users: one engine thread each)
            g = self.graphs
            if g is not None and not constrained and g.serves(n, vocab):
                out, lp = g.sample(logits, rows, self.eos_token_ids, want, filters)
                return SampleOutput(out.tolist(), to_token_logprobs(out, lp, params))
            k = self._buffers(n, vocab, dev)
            k.state.write(list(range(n)), rows, self.eos_token_ids)
            x = logits.to(torch.float32, copy=True)  # the caller's logits stay as they were
            mask = token_mask
            if mask is None and constrained:
                mask = host_masks(matchers, vocab, dev)
            slots = k.slots[:n]
            lp = k.logprobs if want else None
            sample_step(x, slots, torch.ones_like(slots), k.state, k.out, lp, filters, mask)
            out = k.out[:n]
            return SampleOutput(out.tolist(), to_token_logprobs(out, lp, params))


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
