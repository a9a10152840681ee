"""Device helpers shared by the sampler's kernels (kernels/triton_sampling*.py).

The noise is the torch twin's (engine/sampling_math.py: hash32, noise_keys, gumbel) written in
Triton with the same integer arithmetic, so both give the same bits for a (seed, step, token).
`last_program` is the split-reduction handshake: every program of a row stores its partial
results, then takes a ticket; the one holding the last ticket sees them all (acquire/release
on the ticket) and finishes the row, then rewinds the ticket for the next launch. The partials
are read in chunk order whoever is last, so the result never depends on scheduling.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def hash32(x):
    """lowbias32 on uint32 (wraps like the twin's int64 arithmetic masked to 32 bits)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def noise_keys(seed, step):
    """(k1, k2) of a row from its int64 seed (uint64 bits) and step: the twin's noise_keys."""
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    b = hash32(seed_lo ^ hash32(seed_hi ^ 0x243F6A88))
    k1 = hash32((step & 0xFFFFFFFF).to(tl.uint32) ^ b ^ 0x85A308D3)
    return k1, hash32(k1 ^ 0x13198A2E)


@triton.jit
def _log(x, FAST: tl.constexpr):
    """log x: the GPU's approximate log (lg2.approx: 3 ulp, or 2^-21.4 absolute on [0.5, 2]),
    whose cost is what a race pass spends beyond its loads; tl.log under the interpreter."""
    if FAST:
        return libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit
def neg_log_neg_log_u(idx, k1, k2, FAST: tl.constexpr):
    """log(-log(u)) of the token ids idx: z + Gumbel is z - this (the twin adds -this, and
    computes it the same way). -log(u) for u >= 1/2 is 2 atanh(v / (2 - v)), v = 1 - u exact, by
    its series: an approximate log is only accurate in absolute terms there, and the largest
    noises (u near 1, -log(u) near 2^-25) are the likely winners."""
    k = hash32(hash32(idx.to(tl.uint32) + k1) ^ k2) >> 8
    u = (k.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    v = ((16777215 - k).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    w = v / (2.0 - v)
    w2 = w * w
    p = w2 * (1.0 / 15.0) + (1.0 / 13.0)
    p = p * w2 + (1.0 / 11.0)
    p = p * w2 + (1.0 / 9.0)
    p = p * w2 + (1.0 / 7.0)
    p = p * w2 + (1.0 / 5.0)
    p = p * w2 + (1.0 / 3.0)
    p = p * w2 + 1.0
    e = tl.where(u < 0.5, -_log(u, FAST), 2.0 * w * p)
    return _log(e, FAST)


@triton.jit
def zkey(z):
    """Order-preserving int64 key of float32 z (the candidate lists sort on it)."""
    bits = z.to(tl.float32).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def unkey(k):
    """The float32 whose zkey is k."""
    k32 = k.to(tl.int32)
    return tl.where(k32 < 0, k32 ^ 0x7FFFFFFF, k32).to(tl.float32, bitcast=True)


@triton.jit
def chunk_z(x_ptr, stride_x, V, slot_ptr, temp_ptr, m_ptr, row, c, CHUNK: tl.constexpr):
    """Chunk c of a random row: token ids, the in-vocabulary mask and z = (x - m) * (1 / T)."""
    temp = tl.load(temp_ptr + tl.load(slot_ptr + row).to(tl.int64))
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    return offs, mask, (x - tl.load(m_ptr + row)) * (1.0 / temp)


@triton.jit
def last_program(ticket_ptr, row, C):
    """True in the last of row's C programs to get here (after their stores); rewinds the ticket."""
    tl.debug_barrier()  # every thread of this program has stored its partials
    ticket = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel", scope="gpu")
    last = ticket == C - 1
    if last:
        tl.store(ticket_ptr + row, 0)
    return last


@triton.jit
def first_best(part_s_ptr, part_i_ptr, base, C, V, CP: tl.constexpr):
    """(best, first index of it) over a row's C chunk partials at base (chunks in token order)."""
    cs = tl.arange(0, CP)
    s = tl.load(part_s_ptr + base + cs, mask=cs < C, other=float("-inf"), cache_modifier=".cg")
    i = tl.load(part_i_ptr + base + cs, mask=cs < C, other=V, cache_modifier=".cg")
    best = tl.max(s, axis=0)
    return best, tl.min(tl.where(s == best, i, V), axis=0)


@triton.jit
def finish(row, slot, tok, out_ptr, live_ptr, frozen, step_ptr, counts_ptr, stride_c, status_ptr):
    """Row's token is tok: written out, the slot's step and output count advanced by live."""
    tl.store(out_ptr + row, tok)
    live = tl.load(live_ptr + row)
    live = tl.where(slot == frozen, 0, live)
    if live != 0:
        tl.store(step_ptr + slot, tl.load(step_ptr + slot) + live)
        cell = counts_ptr + slot * stride_c + tok
        tl.store(cell, tl.load(cell) + live.to(tl.int32))
    tl.store(status_ptr + row, 1)


@triton.jit
def sorted_list(list_ptr, total, S: tl.constexpr):
    """The first S entries of a list of `total` int64 (padded with the minimum), descending."""
    u = tl.arange(0, S)
    got = tl.load(list_ptr + u, mask=u < total, other=-9223372036854775808, cache_modifier=".cg")
    return tl.sort(got, descending=True)
