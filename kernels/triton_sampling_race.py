"""The race passes of the sampler (kernels/triton_sampling.py), for random rows the first pass
did not finish.

A row's token is argmax over its kept set S of z + Gumbel(seed, step, token), z = (x - m) / T.
S is an upper set in z (min-p floor, top-k, then top-p: the mass strictly above a token, over
the tokens kept so far, below top_p of their mass). So the race runs by rejection, with the
same noise every round: the winner w over {z >= lo} either is in S (then it is also the
argmax over S) or every token with z <= z_w is out of S too, and the next round races over
{z > z_w}. Each round is one pass: it checks the last candidate (its mass above) and races
the survivors; a candidate passes with probability >= top_p, so rounds are few.

`race_kernel` (program per row chunk, the last one of a row decides): status 0 races over
{z >= lo} (and sums the kept mass when top-p is on); status 3 checks the candidate (and,
with RACE, races after it). A filtered step launches it a few times (race, then check only:
most candidates pass, so that pass skips the noise; then check-and-race); `exact_kernel` (one program per
row, whole chunks per step: its loads are what bound it) then loops until the few rows left
are done. Which launch decides a row depends on that row alone, so its token never depends
on its batch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from splitserve.kernels.triton_sampling_common import (
    finish,
    first_best,
    last_program,
    neg_log_neg_log_u,
    noise_keys,
)


@triton.jit
def _chunk_pass(xr, c, CHUNK, V, m, temp, lo, zc, any_z, need_mass, k1, k2,
                BLOCK: tl.constexpr, RACE: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """Over chunk c: the best z + Gumbel and its first index among tokens with z >= lo and
    (any_z or z > zc) (when RACE), and the sum of their exp(z) when need_mass."""
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int64) + V  # no racer: V (a finished loop, never token 0)
    acc = tl.zeros([BLOCK], tl.float32)
    start0 = c * CHUNK
    end = tl.minimum(start0 + CHUNK, V)
    rt = 1.0 / temp  # z = (x - m) * (1 / T) everywhere, as the twin computes it
    for start in range(start0, end, BLOCK):
        idx = start + offs
        mask = idx < end
        z = (tl.load(xr + idx, mask=mask, other=0.0) - m) * rt
        racing = mask & (z >= lo) & (any_z | (z > zc))
        if RACE:
            score = tl.where(racing, z - neg_log_neg_log_u(idx, k1, k2, FAST), float("-inf"))
            better = score > best
            best_i = tl.where(better, idx.to(tl.int64), best_i)
            best = tl.where(better, score, best)
        if need_mass:
            acc += tl.where(racing, tl.exp(z), 0.0)
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, best_i, V), axis=0), tl.sum(acc, axis=0)


@triton.jit
def race_kernel(
    x_ptr, stride_x, V, slot_ptr, live_ptr, out_ptr, frozen,
    temp_ptr, topp_ptr, seed_ptr, step_ptr, counts_ptr, stride_c,
    m_ptr, status_ptr, lo_ptr, cand_ptr, zc_ptr, mass_ptr,
    part_s_ptr, part_i_ptr, part_e_ptr, ticket_ptr, C, CHUNK,
    BLOCK: tl.constexpr, CP: tl.constexpr, RACE: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """RACE: status-0 rows race (and sum their kept mass), status-3 rows check their candidate
    and race the survivors; else only status-3 rows, checked (a rejected one keeps its
    candidate: exact_kernel races after it)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    status = tl.load(status_ptr + row)
    if ((status == 0) & RACE) | (status == 3):
        slot = tl.load(slot_ptr + row).to(tl.int64)
        temp = tl.load(temp_ptr + slot)
        top_p = tl.load(topp_ptr + slot)
        m = tl.load(m_ptr + row)
        xr = x_ptr + row * stride_x
        k1, k2 = noise_keys(tl.load(seed_ptr + slot), tl.load(step_ptr + slot))
        best, best_i, mass = _chunk_pass(
            xr, c, CHUNK, V, m, temp, tl.load(lo_ptr + row), tl.load(zc_ptr + row),
            status == 0, top_p < 1.0, k1, k2, BLOCK, RACE, FAST,
        )  # fmt: skip
        base = row * C
        tl.store(part_s_ptr + base + c, best)
        tl.store(part_i_ptr + base + c, best_i)
        tl.store(part_e_ptr + base + c, mass)
        if last_program(ticket_ptr, row, C):
            _, win = first_best(part_s_ptr, part_i_ptr, base, C, V, CP)
            cs = tl.arange(0, CP)
            parts = tl.load(part_e_ptr + base + cs, mask=cs < C, other=0.0, cache_modifier=".cg")
            total = tl.sum(parts, axis=0)
            if status == 0:
                if top_p < 1.0:  # the winner becomes the candidate, checked next round
                    tl.store(mass_ptr + row, total)
                    tl.store(status_ptr + row, 3)
                    tl.store(cand_ptr + row, win)
                    tl.store(zc_ptr + row, (tl.load(xr + win) - m) * (1.0 / temp))
                else:
                    finish(row, slot, win, out_ptr, live_ptr, frozen, step_ptr, counts_ptr,
                           stride_c, status_ptr)  # fmt: skip
            elif (total < top_p * tl.load(mass_ptr + row)) | (RACE & (win >= V)):  # cand in S
                finish(row, slot, tl.load(cand_ptr + row), out_ptr, live_ptr, frozen, step_ptr,
                       counts_ptr, stride_c, status_ptr)  # fmt: skip
            elif RACE:
                tl.store(cand_ptr + row, win)
                tl.store(zc_ptr + row, (tl.load(xr + win) - m) * (1.0 / temp))


@triton.jit
def _row_pass(xr, C, CHUNK, V, m, temp, lo, zc, any_z, need_mass, k1, k2,
              BLOCK: tl.constexpr, CP: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """_chunk_pass over every chunk of the row, combined as race_kernel combines them."""
    cs = tl.arange(0, CP)
    s = tl.full([CP], float("-inf"), tl.float32)
    i = tl.full([CP], V, tl.int64)
    e = tl.zeros([CP], tl.float32)
    for c in range(0, C):
        b, bi, me = _chunk_pass(
            xr, c, CHUNK, V, m, temp, lo, zc, any_z, need_mass, k1, k2, BLOCK, True, FAST
        )
        s = tl.where(cs == c, b, s)
        i = tl.where(cs == c, bi, i)
        e = tl.where(cs == c, me, e)
    best = tl.max(s, axis=0)
    return tl.min(tl.where(s == best, i, V), axis=0), tl.sum(e, axis=0)


@triton.jit
def exact_kernel(
    x_ptr, stride_x, V, slot_ptr, live_ptr, out_ptr, frozen,
    temp_ptr, topp_ptr, seed_ptr, step_ptr, counts_ptr, stride_c,
    m_ptr, status_ptr, lo_ptr, cand_ptr, zc_ptr, mass_ptr, C, CHUNK,
    BLOCK: tl.constexpr, CP: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """One program per row: finishes the rows whose top-p candidate is still unchecked or was
    rejected (status 3), looping over the whole row as often as it takes."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(status_ptr + row) == 3:
        slot = tl.load(slot_ptr + row).to(tl.int64)
        temp = tl.load(temp_ptr + slot)
        top_p = tl.load(topp_ptr + slot)
        m = tl.load(m_ptr + row)
        lo = tl.load(lo_ptr + row)
        xr = x_ptr + row * stride_x
        k1, k2 = noise_keys(tl.load(seed_ptr + slot), tl.load(step_ptr + slot))
        cand = tl.load(cand_ptr + row)
        zc = tl.load(zc_ptr + row)
        mass = tl.load(mass_ptr + row)
        waiting = True
        while waiting:
            win, above = _row_pass(xr, C, CHUNK, V, m, temp, lo, zc, False, True, k1, k2,
                                   BLOCK, CP, FAST)  # fmt: skip
            if (above < top_p * mass) | (win >= V):
                waiting = False
            else:
                cand = win
                zc = (tl.load(xr + win) - m) * (1.0 / temp)
        finish(row, slot, cand, out_ptr, live_ptr, frozen, step_ptr, counts_ptr, stride_c,
               status_ptr)  # fmt: skip
