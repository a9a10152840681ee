"""The top-k threshold of the sampler (kernels/triton_sampling.py), without a vocabulary sort.

`compact_kernel` (status 4): the first pass gave a lower bound z_t on the k-th largest z (the
k-th largest sub-block max), so the tokens with z >= z_t are few (about k on any row but a
nearly constant one) and hold every token the filter keeps. Each program appends its own
(packed key, index) to the row's list (one atomic per token listed); the last program sorts
the list (order-free: the result does not depend on who appended first) and reads the k-th;
a row without top-p is then raced among its listed tokens at or above the k-th (the kept set,
min-p floor included) with the race pass's noise, and done. A list longer than CAP leaves the
row to the radix select (status 2).

`radix_kernel` (status 2): the k-th largest z = (x - m) / T of a row, as its order-preserving key made unsigned
(u = zkey(z) + 2^31, 32 bits), is found 8 bits per launch, most significant first: each
program (row, chunk) counts, among its tokens whose u matches the digits found so far, how
many fall in each of the 256 values of the next digit; the last program of the row sums the
chunks' counts and keeps the digit holding the k-th largest (counting down from the top),
and how many of the k lie above it. After the fourth launch the prefix is the k-th largest
key exactly (ties included: the filter keeps z >= it, every token tied at the k-th stays, as
the twin's rule); the row's lower bound becomes max(min-p floor, that z) and it goes on to
the race (status 0). Counts are integers, so the result does not depend on order at all.
"""

from __future__ import annotations

import triton
import triton.language as tl

from splitserve.kernels.triton_sampling_common import (
    chunk_z,
    finish,
    last_program,
    neg_log_neg_log_u,
    noise_keys,
    sorted_list,
    unkey,
    zkey,
)

MIN64: tl.constexpr = tl.constexpr(-9223372036854775808)


@triton.jit
def _settle(srt, total, row, slot, V, lo_ptr, status_ptr, krem_ptr, topp_ptr, seed_ptr,
            step_ptr, out_ptr, live_ptr, frozen, counts_ptr, stride_c, FAST: tl.constexpr,
            S: tl.constexpr):  # fmt: skip
    """From the row's sorted list: its k-th largest z bounds the kept set from below; without
    top-p the kept set is the listed tokens at or above it, raced here with the same noise the
    race pass would draw (so no race pass reads the row again); with top-p, on to the race."""
    u = tl.arange(0, S)
    kth = tl.max(tl.where(u == tl.load(krem_ptr + row) - 1, srt, MIN64), axis=0)
    thr = tl.maximum(tl.load(lo_ptr + row), unkey(kth >> 32))
    tl.store(lo_ptr + row, thr)
    if tl.load(topp_ptr + slot) < 1.0:
        tl.store(status_ptr + row, 0)
    else:
        z = unkey(srt >> 32)
        ids = 0xFFFFFFFF - (srt & 0xFFFFFFFF)
        k1, k2 = noise_keys(tl.load(seed_ptr + slot), tl.load(step_ptr + slot))
        kept = (u < total) & (z >= thr)
        score = tl.where(kept, z - neg_log_neg_log_u(ids, k1, k2, FAST), float("-inf"))
        best = tl.max(score, axis=0)
        win = tl.min(tl.where(kept & (score == best), ids, V), axis=0)
        finish(row, slot, win, out_ptr, live_ptr, frozen, step_ptr, counts_ptr, stride_c,
               status_ptr)  # fmt: skip


@triton.jit
def compact_kernel(
    x_ptr, stride_x, V, slot_ptr, live_ptr, out_ptr, frozen, temp_ptr, topp_ptr, seed_ptr,
    step_ptr, counts_ptr, stride_c, m_ptr, status_ptr, lo_ptr, zt_ptr, krem_ptr,
    count_ptr, list_ptr, ticket_ptr, C, CHUNK: tl.constexpr, CAP: tl.constexpr,
    FAST: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if tl.load(status_ptr + row) == 4:
        offs, mask, z = chunk_z(x_ptr, stride_x, V, slot_ptr, temp_ptr, m_ptr, row, c, CHUNK)
        sel = mask & (z >= tl.load(zt_ptr + row))
        # a slot per selected token (few per chunk: one atomic each, no scan of the chunk)
        pos = tl.atomic_add(count_ptr + row + tl.zeros_like(offs), 1, mask=sel, sem="relaxed")
        packed = (zkey(z) << 32) | (0xFFFFFFFF - offs.to(tl.int64))
        tl.store(list_ptr + row * CAP + pos, packed, mask=sel & (pos < CAP))
        if last_program(ticket_ptr, row, C):
            total = tl.atomic_add(count_ptr + row, 0)
            slot = tl.load(slot_ptr + row).to(tl.int64)
            lst = list_ptr + row * CAP
            args = (row, slot, V, lo_ptr, status_ptr, krem_ptr, topp_ptr, seed_ptr, step_ptr,
                    out_ptr, live_ptr, frozen, counts_ptr, stride_c)  # fmt: skip
            if total > CAP:  # the list overflowed: the radix select
                tl.store(status_ptr + row, 2)
            elif total <= 128:  # a short list, the usual case, sorts in a small block
                _settle(sorted_list(lst, total, 128), total, *args, FAST, 128)
            else:
                _settle(sorted_list(lst, total, CAP), total, *args, FAST, CAP)


@triton.jit
def radix_kernel(
    x_ptr, stride_x, V, slot_ptr, temp_ptr, m_ptr, status_ptr, lo_ptr, krem_ptr, prefix_ptr,
    hist_ptr, ticket_ptr, C, CHUNK: tl.constexpr, SHIFT: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if tl.load(status_ptr + row) == 2:
        prefix = tl.load(prefix_ptr + row)
        offs, mask, z = chunk_z(x_ptr, stride_x, V, slot_ptr, temp_ptr, m_ptr, row, c, CHUNK)
        u = zkey(z) + 2147483648
        match = mask & ((u >> (SHIFT + 8)) == prefix)
        digit = tl.where(match, (u >> SHIFT) & 255, 256).to(tl.int32)
        hist = tl.histogram(digit, 512)
        d = tl.arange(0, 512)
        tl.store(hist_ptr + (row * C + c) * 256 + d, hist, mask=d < 256)
        if last_program(ticket_ptr, row, C):
            cs = tl.arange(0, CP)[:, None]
            b = tl.arange(0, 256)[None, :]
            parts = tl.load(
                hist_ptr + (row * C + cs) * 256 + b, mask=cs < C, other=0, cache_modifier=".cg"
            )
            counts = tl.sum(parts, axis=0)
            krem = tl.load(krem_ptr + row)
            total = tl.sum(counts, axis=0)
            at_or_above = total - tl.cumsum(counts, axis=0) + counts
            bins = tl.arange(0, 256)
            pick = tl.max(tl.where(at_or_above >= krem, bins, -1), axis=0)
            above = tl.sum(tl.where(bins > pick, counts, 0), axis=0)
            tl.store(krem_ptr + row, krem - above)
            prefix = prefix * 256 + pick
            if SHIFT == 0:  # the whole key is known: the k-th largest z
                kz = unkey(prefix - 2147483648)
                tl.store(lo_ptr + row, tl.maximum(tl.load(lo_ptr + row), kz))
                tl.store(status_ptr + row, 0)
            else:
                tl.store(prefix_ptr + row, prefix)
