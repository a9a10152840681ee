"""Sampling without a vocabulary sort: one Triton program per row (engine/sampling_math.py has
the rules and the torch twin).

    pass 0     penalties in place (rows that have them: counts / prompt_seen of the row's
               state slot), row max and its first index (greedy rows stop here)
    top-k      16-ary search over the order-preserving int32 key of z = (x - max) / T for the
               largest key with count(key >= t) >= k     (triton_sampling_search.py, 9 passes)
    top-p      the same search for the smallest key with mass(key > t) < top_p * kept mass
    race       argmax over kept tokens of z + Gumbel(hash(seed, step, token))

Every loop visits the row in the same block order whatever the batch, so a row's token does
not depend on the rows beside it. Parameters are read through the row's state slot, so one
captured launch serves any mix of greedy, filtered, seeded and penalised rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import interpreting, pow2
from splitserve.kernels.triton_sampling_search import key as _key
from splitserve.kernels.triton_sampling_search import thresholds


@triton.jit
def _hash32(x):
    """lowbias32 on uint32 (wraps like the twin's int64 arithmetic masked to 32 bits)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _pen_max_kernel(
    x_ptr, stride_x, V, slot_ptr, part_v_ptr, part_i_ptr, C, CHUNK,
    pen_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr, seen_ptr, stride_c,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Chunk c of row r: penalties in place (rows that have them), the chunk's max and first
    index of it into part_*[r, c]."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    xr = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    has_pen = tl.load(pen_ptr + slot)
    rep = tl.load(rep_ptr + slot)
    freq = tl.load(freq_ptr + slot)
    pres = tl.load(pres_ptr + slot)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int64)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        idx = start + offs
        mask = idx < hi
        v = tl.load(xr + idx, mask=mask, other=float("-inf"))
        if has_pen != 0:
            cnt = tl.load(counts_ptr + slot * stride_c + idx, mask=mask, other=0)
            s = tl.load(seen_ptr + slot * stride_c + idx, mask=mask, other=0)
            seen = (s != 0) | (cnt > 0)
            v = tl.where(seen, tl.where(v > 0, v / rep, v * rep), v)
            v = v - freq * cnt.to(tl.float32)
            v = v - pres * (cnt > 0).to(tl.float32)
            tl.store(xr + idx, v, mask=mask)
        better = v > best
        best_i = tl.where(better, idx.to(tl.int64), best_i)
        best = tl.where(better, v, best)
    m = tl.max(best, axis=0)
    tl.store(part_v_ptr + row * C + c, m)
    tl.store(part_i_ptr + row * C + c, tl.min(tl.where(best == m, best_i, V), axis=0))


@triton.jit
def _race_kernel(
    x_ptr, stride_x, V, slot_ptr, m_ptr, thr_ptr, part_v_ptr, part_i_ptr, C, CHUNK,
    temp_ptr, seed_ptr, step_ptr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Chunk c of row r: the best kept z + Gumbel(seed, step, token) and its first index."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    temp = tl.load(temp_ptr + slot)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int64)
    if temp > 0:
        xr = x_ptr + row * stride_x
        offs = tl.arange(0, BLOCK)
        m = tl.load(m_ptr + row)
        thr = tl.load(thr_ptr + row)
        seed = tl.load(seed_ptr + slot)
        step = tl.load(step_ptr + slot)
        seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        b = _hash32(seed_lo ^ _hash32(seed_hi ^ 0x243F6A88))
        k1 = _hash32((step & 0xFFFFFFFF).to(tl.uint32) ^ b ^ 0x85A308D3)
        k2 = _hash32(k1 ^ 0x13198A2E)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            mask = idx < hi
            z = (tl.load(xr + idx, mask=mask, other=0.0) - m) / temp
            h = _hash32(_hash32(idx.to(tl.uint32) + k1) ^ k2)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = tl.where(mask & (_key(z) >= thr), z - tl.log(-tl.log(u)), float("-inf"))
            better = score > best
            best_i = tl.where(better, idx.to(tl.int64), best_i)
            best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    tl.store(part_v_ptr + row * C + c, top)
    tl.store(part_i_ptr + row * C + c, tl.min(tl.where(best == top, best_i, V), axis=0))


def _chunks(vocab: int, block: int) -> tuple[int, int]:
    """Programs per row (each a whole number of blocks, about 4 blocks each): a function of the
    vocabulary only, never of the batch, so the float sums of the top-p search add up in the
    same order whatever a row's batch and a seeded row's token does not depend on it."""
    c = max(1, vocab // (4 * block))
    chunk = -(-vocab // c)
    chunk = -(-chunk // block) * block
    return -(-vocab // chunk), chunk


def _reduce(part_v: torch.Tensor, part_i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max over chunks and the first index of it (chunks are in token order)."""
    which = part_v.argmax(dim=1, keepdim=True)
    return part_v.gather(1, which).squeeze(1), part_i.gather(1, which).squeeze(1)


def sample_rows(
    x: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, state, filters: bool = True
) -> None:
    """out[r] = token of row r of the fp32 logits x [n, V] (penalties applied to x in place),
    with the parameters of state slot slots[r]; `state` holds the per-slot tensors
    (engine/sampling_state.py). filters=False: no row has top-k / top-p (their searches
    are not launched)."""
    n, vocab = x.shape
    if n == 0:
        return
    block = min(pow2(vocab), 64 if interpreting() else 1024)
    c, chunk = _chunks(vocab, block)
    s = state
    part_v = torch.empty(n, c, dtype=torch.float32, device=x.device)
    part_i = torch.empty(n, c, dtype=torch.int64, device=x.device)
    _pen_max_kernel[(n, c)](
        x, x.stride(0), vocab, slots, part_v, part_i, c, chunk,
        s.has_pen, s.rep, s.freq, s.pres, s.counts, s.prompt_seen, s.counts.stride(0),
        BLOCK=block, num_warps=4,
    )  # fmt: skip
    m, first = _reduce(part_v, part_i)
    thr = thresholds(x, slots, m, c, chunk, block, s, filters)
    _race_kernel[(n, c)](
        x, x.stride(0), vocab, slots, m, thr, part_v, part_i, c, chunk,
        s.temperature, s.seed, s.step,
        BLOCK=block, num_warps=4,
    )  # fmt: skip
    _, raced = _reduce(part_v, part_i)
    random = s.temperature.index_select(0, slots) > 0
    out.copy_(torch.where(random, raced, first))
