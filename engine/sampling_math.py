"""The sampling arithmetic, as torch ops that capture in a CUDA graph (one copy of the rules).

Per row, from fp32 logits x (vLLM's order):

    x += logit_bias;  x[EOS, stop ids] = -inf while step < min_tokens       (add_bias_and_bans)
    penalties: repetition over prompt + output, then frequency, presence     (apply_penalties)
    greedy row: argmax(x)
    random row: z = (x - max x) / T;  keep z >= log(min_p)  (p >= min_p * p_max)
                keep the top_k largest (every token tied at the k-th stays)
                keep tokens whose mass strictly above them is < top_p of the kept mass
                token = argmax over kept of z + Gumbel(seed, step, token)

Nothing sorts the vocabulary on the GPU: there top-k is a bounded, compacted select and the
race runs by rejection (kernels/triton_sampling.py). `sample_rows_torch` is the reference for
CPU tensors; it sorts, with exactly the same keep rules.

The noise is counter-based: two rounds of the lowbias32 integer hash keyed by (seed, step,
token), done in int64 with 32-bit masks, so the torch path and the Triton kernel produce the
same bits on any device. A seeded row's tokens therefore depend only on its logits, its seed
and its step, never on its batch, row, device or process. The logits do depend on the batch
size under bf16 kernels (different split-K / tiling), so a seeded request is reproducible
bit for bit on the fp32 path and "the same up to bf16 rounding" on bf16; see docs.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
TINY = torch.finfo(torch.float32).tiny  # a temperature below float32's range divides by this
_INV24 = 1.0 / 16777216.0


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons) on int64 tensors holding uint32 values; returns the same."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def noise_keys(seed: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row keys (k1, k2) for int64 seeds (uint64 bits) and steps."""
    lo, hi = seed & M32, (seed >> 32) & M32
    b = hash32(lo ^ hash32(hi ^ 0x243F6A88))
    k1 = hash32((step & M32) ^ b ^ 0x85A308D3)
    k2 = hash32(k1 ^ 0x13198A2E)
    return k1, k2


def gumbel(k1: torch.Tensor, k2: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] float32 Gumbel noise -log(-log(u)) from per-row keys [n] (int64). -log(u) for
    u >= 1/2 is 2 atanh(v / (2 - v)), v = 1 - u, by its series (to w^15, error < 1e-9): the
    kernel computes it so (its fast log is accurate only in absolute terms near 1), and this
    twin the same way, op for op."""
    idx = torch.arange(vocab, device=k1.device, dtype=torch.int64)
    h = hash32(hash32((idx.unsqueeze(0) + k1.unsqueeze(1)) & M32) ^ k2.unsqueeze(1))
    k = h >> 8
    u = (k.to(torch.float32) + 0.5) * _INV24  # (0, 1), exact in float32
    v = ((16777215 - k).to(torch.float32) + 0.5) * _INV24  # 1 - u, exact
    w = v / (2.0 - v)
    w2 = w * w
    p = w2 * (1.0 / 15.0) + (1.0 / 13.0)
    for c in (1.0 / 11.0, 1.0 / 9.0, 1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0):
        p = p * w2 + c
    e = torch.where(u < 0.5, -torch.log(u), 2.0 * w * p)
    return -torch.log(e)


def add_bias_and_bans(
    x: torch.Tensor,
    bias_ids: torch.Tensor,
    bias_vals: torch.Tensor,
    ban_ids: torch.Tensor,
    ban_on: torch.Tensor,
) -> None:
    """In place on x [n, V]: x[r, bias_ids[r, j]] += bias_vals[r, j] (unused entries: id 0, value
    0), and -inf at ban_ids[r, j] (unused: -1) of the rows where ban_on[r]."""
    x.scatter_add_(1, bias_ids.to(torch.int64), bias_vals)
    valid = (ban_ids >= 0) & ban_on.unsqueeze(1)
    fill = torch.where(valid, float("-inf"), 0.0).to(x.dtype)
    x.scatter_add_(1, ban_ids.clamp(min=0).to(torch.int64), fill)


def apply_penalties(
    x: torch.Tensor,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor,
    rep: torch.Tensor,
    freq: torch.Tensor,
    pres: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on x [n, V] with output-token counts [n, V] and prompt_seen [n, V]:
    repetition over prompt + output (positive logits / r, negative * r), then frequency *
    count and presence * (count > 0) subtracted. A row with r=1, f=p=0 comes out unchanged."""
    c = counts.to(x.dtype)
    seen = prompt_seen.bool() | (counts > 0)
    r = rep.unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - freq.unsqueeze(1) * c - pres.unsqueeze(1) * (counts > 0).to(x.dtype)


def _keep_threshold(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """[n, 1] lowest kept z per row (sort-based reference of the kernel's search)."""
    n, vocab = z.shape
    s, _ = z.sort(dim=-1, descending=True)
    thr = torch.where(min_p > 0, torch.log(min_p.clamp(min=1e-38)), float("-inf")).unsqueeze(1)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).clamp(max=vocab) - 1
    thr = torch.maximum(thr, s.gather(1, k.to(torch.int64).unsqueeze(1)))
    e = torch.where(s >= thr, torch.exp(s), 0.0)
    total = e.sum(dim=-1, keepdim=True)
    # mass strictly above each sorted entry: the exclusive cumsum at the first of its ties
    asc = s.flip(-1).contiguous()
    above = vocab - torch.searchsorted(asc, s.contiguous(), right=True)
    cum = torch.cat([torch.zeros_like(total), e.cumsum(dim=-1)], dim=-1)
    mass_above = cum.gather(1, above)
    keep = (mass_above < top_p.unsqueeze(1) * total) & (s >= thr)
    last = keep.sum(dim=-1, keepdim=True).clamp(min=1) - 1  # the top entry is always kept
    p_thr = s.gather(1, last)
    return torch.where((top_p < 1.0).unsqueeze(1), torch.maximum(thr, p_thr), thr)


def sample_rows_torch(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
) -> torch.Tensor:
    """Tokens [n] int64 from processed fp32 logits x [n, V] and per-row parameters [n]
    (temperature 0: greedy). The torch twin of kernels/triton_sampling.py."""
    greedy_tok = x.argmax(dim=-1)
    m = x.amax(dim=-1, keepdim=True)
    t = torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    z = (x - m) * (1.0 / t)  # the kernels multiply by the reciprocal too (one division a row)
    thr = _keep_threshold(z, top_k, top_p, min_p)
    k1, k2 = noise_keys(seed, step)
    score = torch.where(z >= thr, z + gumbel(k1, k2, x.shape[1]), float("-inf"))
    return torch.where(temperature > 0, score.argmax(dim=-1), greedy_tok)


def raw_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sampled token's logprob [n], top_n logprobs [n, top_n] descending, their ids), all
    under the RAW logits (before bias, penalties and temperature), as vLLM reports them."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    sampled = logits.gather(1, tokens.unsqueeze(1)) - lse
    vals, ids = logits.topk(min(top_n, logits.shape[1]), dim=-1)
    return sampled.squeeze(1), vals - lse, ids
