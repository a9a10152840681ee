"""Turns a step's logits into one token per sequence, vectorised over the batch.

Order (vLLM's):

    raw logits ──► logprobs (log_softmax of the RAW logits, only rows that ask)
        │
        ├─► repetition penalty (prompt + output tokens) ─► frequency / presence (output)
        │
        ├─► greedy rows: argmax
        └─► random rows: temperature ─► min_p ─► top_k ─► top_p ─► argmax(probs / Exp(1))

A batch of greedy rows without penalties is one argmax (no copy, no softmax).

Reproducibility: a seeded row draws its Exp(1) noise on the CPU from a generator seeded
with hash(seed, step), step = tokens generated so far. The noise therefore depends only on
(seed, step, vocab size), never on the batch, its order, the device or the process, so a
prefill worker sampling token 0 and a decode worker sampling tokens 1.. give the sequence
that one process would. The race argmax(p_i / E_i) picks i with probability p_i, and uses
one noise value per vocab entry, so filtering (which zeroes p_i) never shifts the noise.
Unseeded rows draw from the sampler's own per-device generator, in one call.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from splitserve.request.sampling_params import SamplingParams

_M64 = (1 << 64) - 1
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True, slots=True)
class SeqSamplingInfo:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far; its length is the step index

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


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def row_seed(seed: int, step: int) -> int:
    """Generator seed for (request seed, step). Hashed, not seed * c + step, because torch's
    CPU generator keeps only the low 32 bits of its seed: a hash spreads all 64 input bits
    into them, so seeds that differ only in high bits do not share a stream."""
    return _splitmix64(_splitmix64(seed & _M64) ^ step)


def seeded_noise(
    seed: int, step: int, vocab_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Exp(1) noise [vocab_size] (float32, CPU) for one seeded row at one step.

    Built as -log(U) from `torch.rand`, whose CPU kernel is a plain serial Mersenne-twister
    loop (unlike `exponential_`, which uses MKL where present), so the numbers are the same
    on every build and machine. float32 U (24-bit) is half the cost of float64; it only
    truncates the noise's tail beyond ~17, an event of probability 6e-8 per entry."""
    g = torch.Generator(device="cpu")
    g.manual_seed(row_seed(seed, step))
    u = torch.rand(vocab_size, generator=g, out=out)
    return u.clamp_(min=_TINY).log_().neg_()


def _counts(
    token_lists: list[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[n, V] float32 occurrence counts, one scatter_add for the whole batch. Ids outside
    the vocabulary (a prompt from a larger tokenizer) have no logit, so they are dropped."""
    n = len(token_lists)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    total = int(lengths.sum())  # np.fromiter: ~5x faster than torch.tensor(list) for long prompts
    flat = torch.from_numpy(
        np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=total)
    )
    rows = torch.repeat_interleave(torch.arange(n), lengths)
    keep = (flat >= 0) & (flat < vocab_size)
    index = (rows[keep] * vocab_size + flat[keep]).to(device)
    counts = torch.zeros(n * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    return counts.view(n, vocab_size)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def apply_penalties(x: torch.Tensor, seqs: Sequence[SeqSamplingInfo]) -> None:
    """vLLM's penalties, in place on float32 logits [B, V], only on rows that have any:
    repetition (prompt + output tokens: positive logits / r, negative * r), then
    frequency * count and presence * (count > 0) subtracted, over output tokens only."""
    rows = [i for i, s in enumerate(seqs) if s.params.needs_penalties]
    if not rows:
        return
    vocab, dev = x.shape[1], x.device
    sub = x[rows]
    ps = [seqs[i].params for i in rows]
    out_counts = _counts([seqs[i].output_token_ids for i in rows], vocab, dev)
    out_mask = out_counts > 0
    if any(p.repetition_penalty != 1.0 for p in ps):
        seen = out_mask | (_counts([seqs[i].prompt_token_ids for i in rows], vocab, dev) > 0)
        rep = _column([p.repetition_penalty for p in ps], dev)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= _column([p.frequency_penalty for p in ps], dev) * out_counts
    sub -= _column([p.presence_penalty for p in ps], dev) * out_mask
    x[rows] = sub


class Sampler:
    """Holds only the generators for unseeded rows (one per device, seeded from `seed`, or
    from OS entropy when `seed` is None) and a small thread pool: seeded rows' CPU noise
    (~0.5 ms per row at V=128k) is drawn in parallel, as torch releases the GIL."""

    def __init__(self, seed: int | None = None, noise_threads: int = 4) -> None:
        self._seed = secrets.randbits(63) if seed is None else seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._noise_threads = max(1, noise_threads)
        self._pool: ThreadPoolExecutor | None = None

    def sample(self, logits: torch.Tensor, seqs: Sequence[SeqSamplingInfo]) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(
                f"logits must be [batch, vocab] with batch={len(seqs)}, got {tuple(logits.shape)}"
            )
        params = [s.params for s in seqs]
        if all(p.is_greedy and not p.needs_penalties for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            x = logits.to(torch.float32, copy=True)
            apply_penalties(x, seqs)
            greedy = [i for i, p in enumerate(params) if p.is_greedy]
            rand = [i for i, p in enumerate(params) if not p.is_greedy]
            if not rand:
                tokens = x.argmax(dim=-1)
            elif not greedy:
                tokens = self._sample_random(x, seqs)
            else:
                tokens = torch.empty(len(seqs), dtype=torch.long, device=x.device)
                tokens[greedy] = x[greedy].argmax(dim=-1)
                tokens[rand] = self._sample_random(x[rand], [seqs[i] for i in rand])
        return SampleOutput(tokens.tolist(), self._logprobs(logits, params, tokens))

    # ------------------------------------------------------------------ stages

    def _sample_random(self, x: torch.Tensor, seqs: Sequence[SeqSamplingInfo]) -> torch.Tensor:
        """Temperature, filters, then the exponential race; returns [n] token ids."""
        ps = [s.params for s in seqs]
        dev = x.device
        # Subtracting the row max first keeps a tiny temperature from overflowing to inf; one
        # below float32's range (1e-45 is valid input) divides by the smallest float32 instead.
        temperature = _column([max(p.temperature, _TINY) for p in ps], dev)
        x = (x - x.amax(dim=-1, keepdim=True)) / temperature
        if any(p.min_p > 0 for p in ps):
            probs = x.softmax(dim=-1)
            floor = _column([p.min_p for p in ps], dev) * probs.amax(dim=-1, keepdim=True)
            x = x.masked_fill(probs < floor, float("-inf"))
        if any(p.top_k > 0 or p.top_p < 1.0 for p in ps):
            x = self._top_k_top_p(x, ps)
        probs = x.softmax(dim=-1)
        return probs.div_(self._noise(seqs, x.shape[1], dev)).argmax(dim=-1)

    @staticmethod
    def _top_k_top_p(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
        """One stable sort for both filters (stable so ties cut the same on every device)."""
        vocab, dev = x.shape[1], x.device
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        if any(p.top_k > 0 for p in ps):
            k = torch.tensor(
                [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps], device=dev
            )
            kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))  # ties at the kth stay
        if any(p.top_p < 1.0 for p in ps):
            probs = sorted_x.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs  # the top token always has 0 before it
            top_p = _column([p.top_p if p.top_p < 1.0 else float("inf") for p in ps], dev)
            sorted_x = sorted_x.masked_fill(mass_before >= top_p, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)

    def _noise(
        self, seqs: Sequence[SeqSamplingInfo], vocab: int, dev: torch.device
    ) -> torch.Tensor:
        """[n, V] Exp(1) noise, strictly positive: seeded rows from their own CPU generator,
        the others from this sampler's generator for `dev` in one call."""
        seeded = [j for j, s in enumerate(seqs) if s.params.seed is not None]
        unseeded = [j for j, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            e = torch.empty(len(unseeded), vocab, dtype=torch.float32, device=dev)
            e.exponential_(generator=self._generator(dev)).clamp_(min=_TINY)
            if not seeded:
                return e
        cpu = torch.empty(len(seeded), vocab, dtype=torch.float32)
        jobs = [(seqs[j].params.seed, seqs[j].step, vocab, cpu[k]) for k, j in enumerate(seeded)]
        if len(jobs) > 1 and self._noise_threads > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._noise_threads, thread_name_prefix="sampler-noise"
                )
            list(self._pool.map(lambda job: seeded_noise(*job), jobs))
        else:
            for job in jobs:
                seeded_noise(*job)
        if not unseeded:
            return cpu.to(dev)
        noise = torch.empty(len(seqs), vocab, dtype=torch.float32, device=dev)
        noise[unseeded] = e
        noise[seeded] = cpu.to(dev)
        return noise

    def _generator(self, dev: torch.device) -> torch.Generator:
        g = self._generators.get(dev)
        if g is None:
            g = torch.Generator(device=dev)
            g.manual_seed(self._seed)
            self._generators[dev] = g
        return g

    # ------------------------------------------------------------------ logprobs

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor
    ) -> list[TokenLogprobs | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(params)
        if not rows:
            return out
        lp = torch.log_softmax(logits[rows].to(torch.float32), dim=-1)
        chosen = tokens[rows]
        sampled = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        chosen = chosen.tolist()
        n_max = max(params[i].logprobs for i in rows)
        top_vals, top_ids = lp.topk(n_max, dim=-1) if n_max else (lp[:, :0], lp[:, :0].long())
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            n = params[i].logprobs
            top = list(zip(top_ids[j][:n], top_vals[j][:n]))
            out[i] = TokenLogprobs(chosen[j], sampled[j], top)
        return out
