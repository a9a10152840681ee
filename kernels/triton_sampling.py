"""Sampling without a vocabulary sort: one Triton program per row (engine/sampling_math.py has
the rules and the torch twin).

    pass 0     penalties in place (rows that have them: counts / prompt_seen of the row's
               state slot), row max and its first index (greedy rows stop here)
    top-k      16-ary search over the order-preserving int32 key of z = (x - max) / T for the
               largest key with count(key >= t) >= k            (8-9 passes, 15 pivots each)
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

_NPIV = 16


@triton.jit
def _hash32(x):
    m = tl.cast(0xFFFFFFFF, tl.int64)
    x = x ^ (x >> 16)
    x = (x * tl.cast(0x7FEB352D, tl.int64)) & m
    x = x ^ (x >> 15)
    x = (x * tl.cast(0x846CA68B, tl.int64)) & m
    return x ^ (x >> 16)


@triton.jit
def _key(z):
    """Order-preserving int64 key of float32 z."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _sample_kernel(
    x_ptr, stride_x, V, slot_ptr, out_ptr,
    temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr,
    pen_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr, seen_ptr, stride_c,
    BLOCK: tl.constexpr, NPIV: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    xr = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    temp = tl.load(temp_ptr + slot)
    has_pen = tl.load(pen_ptr + slot)
    rep = tl.load(rep_ptr + slot)
    freq = tl.load(freq_ptr + slot)
    pres = tl.load(pres_ptr + slot)
    # ---- pass 0: penalties in place, max and its first index
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        mask = idx < V
        v = tl.load(xr + idx, mask=mask, other=float("-inf"))
        if has_pen != 0:
            c = tl.load(counts_ptr + slot * stride_c + idx, mask=mask, other=0)
            s = tl.load(seen_ptr + slot * stride_c + idx, mask=mask, other=0)
            seen = (s != 0) | (c > 0)
            v = tl.where(seen, tl.where(v > 0, v / rep, v * rep), v)
            v = v - freq * c.to(tl.float32)
            v = v - pres * (c > 0).to(tl.float32)
            tl.store(xr + idx, v, mask=mask)
        better = v > best
        best_i = tl.where(better, idx.to(tl.int64), best_i)
        best = tl.where(better, v, best)
    m = tl.max(best, axis=0)
    first = tl.min(tl.where(best == m, best_i, V), axis=0)
    tl.debug_barrier()  # the penalised row is re-read by other threads below
    if temp > 0:
        top_k = tl.load(topk_ptr + slot)
        top_p = tl.load(topp_ptr + slot)
        min_p = tl.load(minp_ptr + slot)
        floor = tl.where(min_p > 0, tl.log(tl.maximum(min_p, 1e-38)), float("-inf"))
        thr = _key(floor)
        j = tl.arange(0, NPIV).to(tl.int64)
        if (top_k > 0) & (top_k < V):
            lo = tl.cast(-2147483648, tl.int64)  # count(key >= lo) = V >= k
            hi = tl.cast(1, tl.int64)  # z <= +0 (key 0): count(key >= 1) = 0 < k
            while hi - lo > 1:
                piv = lo + ((hi - lo) * j) // NPIV
                cnt = tl.zeros([NPIV], tl.int32)
                for start in range(0, V, BLOCK):
                    idx = start + offs
                    mask = idx < V
                    v = tl.load(xr + idx, mask=mask, other=0.0)
                    k = tl.where(mask, _key((v - m) / temp), -2147483649)
                    cnt += tl.sum((k[:, None] >= piv[None, :]).to(tl.int32), axis=0)
                new_lo = tl.max(tl.where(cnt >= top_k, piv, lo), axis=0)
                hi = tl.min(tl.where(cnt < top_k, piv, hi), axis=0)
                lo = new_lo
            thr = tl.maximum(thr, lo)
        if top_p < 1.0:
            total = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                mask = idx < V
                z = (tl.load(xr + idx, mask=mask, other=0.0) - m) / temp
                kept = mask & (_key(z) >= thr)
                total += tl.where(kept, tl.exp(z), 0.0)
            target = top_p * tl.sum(total, axis=0)
            lo = thr - 1  # mass(key > lo) = total >= target
            hi = tl.cast(1, tl.int64)  # mass(key > 1) = 0 < target
            while hi - lo > 1:
                piv = lo + ((hi - lo) * j) // NPIV
                mass = tl.zeros([NPIV], tl.float32)
                for start in range(0, V, BLOCK):
                    idx = start + offs
                    mask = idx < V
                    z = (tl.load(xr + idx, mask=mask, other=0.0) - m) / temp
                    k = _key(z)
                    e = tl.where(mask & (k >= thr), tl.exp(z), 0.0)
                    mass += tl.sum(tl.where(k[:, None] > piv[None, :], e[:, None], 0.0), axis=0)
                new_lo = tl.max(tl.where(mass >= target, piv, lo), axis=0)
                hi = tl.min(tl.where(mass < target, piv, hi), axis=0)
                lo = new_lo
            thr = tl.maximum(thr, hi)
        # ---- the race: Gumbel-max over the kept tokens, noise keyed by (seed, step, token)
        seed = tl.load(seed_ptr + slot)
        step = tl.load(step_ptr + slot)
        msk = tl.cast(0xFFFFFFFF, tl.int64)
        b = _hash32((seed & msk) ^ _hash32(((seed >> 32) & msk) ^ 0x243F6A88))
        k1 = _hash32((step & msk) ^ b ^ tl.cast(0x85A308D3, tl.int64))
        k2 = _hash32(k1 ^ 0x13198A2E)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int64)
        for start in range(0, V, BLOCK):
            idx = start + offs
            mask = idx < V
            z = (tl.load(xr + idx, mask=mask, other=0.0) - m) / temp
            h = _hash32(_hash32((idx.to(tl.int64) + k1) & msk) ^ k2)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = tl.where(mask & (_key(z) >= thr), z - tl.log(-tl.log(u)), float("-inf"))
            better = score > best
            best_i = tl.where(better, idx.to(tl.int64), best_i)
            best = tl.where(better, score, best)
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(best == top, best_i, V), axis=0)
    tl.store(out_ptr + row, first)


def sample_rows(x: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, state) -> None:
    """out[r] = token of row r of the fp32 logits x [n, V] (penalties applied to x in place),
    with the parameters of state slot slots[r]; `state` holds the per-slot tensors
    (temperature, top_k, top_p, min_p, seed, step, has_pen, rep, freq, pres, counts,
    prompt_seen), see decode_worker/sampling_state.py."""
    n, vocab = x.shape
    if n == 0:
        return
    block = min(pow2(vocab), 64 if interpreting() else 1024)
    s = state
    _sample_kernel[(n,)](
        x, x.stride(0), vocab, slots, out,
        s.temperature, s.top_k, s.top_p, s.min_p, s.seed, s.step,
        s.has_pen, s.rep, s.freq, s.pres, s.counts, s.prompt_seen, s.counts.stride(0),
        BLOCK=block, NPIV=_NPIV, num_warps=8,
    )  # fmt: skip
