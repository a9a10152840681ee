"""Pass 1 of the sampler (kernels/triton_sampling.py): logits processing, the row max, greedy
rows, and top-k rows resolved from per-chunk candidate lists.

Program (row, c) owns chunk c of the row: it applies the row's logit bias and min_tokens bans
that fall in its chunk and the penalties (in place), and stores the chunk's max and its first
index. A random row with top-k also stores its chunk's KMAX largest tokens, sorted by a packed
(value key, -index) int64. The last program of the row (triton_sampling_common.last_program):

- reduces the row max m and its first index: a greedy row is finished with it;
- a top-k row: the union U of the chunk lists holds, in exact global order, every token whose
  packed key beats tau = the largest chunk cut (the KMAX-th entry of each list); a token
  outside U is <= tau. If the k-th largest is inside that exact prefix and strictly above
  the next entry, every kept token (top-k, min-p, then top-p on the kept mass) is in U, so the
  thresholds and the race (argmax of z + Gumbel over the kept set, the same noise as every
  other path) are done here, on at most C * KMAX entries. Otherwise (k > KMAX, or ties at the
  cut) the row waits for the exact single-program path (status 2);
- any other random row waits for the race passes (status 0, lower bound = the min-p floor).
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
    zkey,
)

MIN64: tl.constexpr = tl.constexpr(-9223372036854775808)


@triton.jit
def _first_of_run(za, sa, zb, sb):
    """Scan over (z, excl) sorted by z descending: the excl of the first entry of each run of
    equal z (associative on sorted input, where equal values are contiguous)."""
    return zb, tl.where(za == zb, sa, sb)


@triton.jit
def _resolve_top_k(
    x_ptr, stride_x, V, row, slot, m, temp, top_k, top_p, floor, cand_ptr, C,
    seed, step, KMAX: tl.constexpr, CP: tl.constexpr, UP: tl.constexpr,
):  # fmt: skip
    """The token of a top-k row from the chunks' candidate lists, or -1 if they cannot decide."""
    u = tl.arange(0, UP)
    base = row * C * KMAX
    pk = tl.load(cand_ptr + base + u, mask=u < C * KMAX, other=MIN64, cache_modifier=".cg")
    cs = tl.arange(0, CP)
    cuts = tl.load(
        cand_ptr + base + cs * KMAX + (KMAX - 1), mask=cs < C, other=MIN64, cache_modifier=".cg"
    )
    tau = tl.max(cuts, axis=0)
    s = tl.sort(pk, descending=True)
    idx = 0xFFFFFFFF - (s & 0xFFFFFFFF)
    exact = (s > tau) & (idx < V)
    v = tl.load(x_ptr + row * stride_x + idx, mask=exact, other=float("-inf"))
    z = tl.where(exact, (v - m) / temp, float("-inf"))
    n_exact = tl.sum(exact.to(tl.int32), axis=0)
    zk = tl.max(tl.where(u == top_k - 1, z, float("-inf")), axis=0)
    above = tl.sum((exact & (z >= zk)).to(tl.int32), axis=0)
    thr = tl.maximum(floor, zk)
    kept = exact & (z >= thr)
    if top_p < 1.0:
        e = tl.where(kept, tl.exp(z), 0.0)
        total = tl.sum(e, axis=0)
        excl = tl.cumsum(e, axis=0) - e
        _, mass_gt = tl.associative_scan((z, excl), 0, _first_of_run)
        kept = kept & (mass_gt < top_p * total)
    k1, k2 = noise_keys(seed, step)
    score = tl.where(kept, z - neg_log_neg_log_u(idx, k1, k2), float("-inf"))
    best = tl.max(score, axis=0)
    tok = tl.min(tl.where(kept & (score == best), idx, V), axis=0)
    # a U entry below the k-th: every kept token is in U (else the exact path decides)
    return tl.where((top_k <= n_exact) & (above < n_exact), tok, -1)


@triton.jit
def prep_kernel(
    x_ptr, stride_x, V, slot_ptr, live_ptr, out_ptr, frozen,
    temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, mint_ptr,
    pen_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr, seen_ptr, stride_c,
    bias_id_ptr, bias_val_ptr, W, ban_ptr, B,
    part_v_ptr, part_i_ptr, cand_ptr, ticket_ptr, m_ptr, status_ptr, lo_ptr, C,
    CHUNK: tl.constexpr, WP: tl.constexpr, BP: tl.constexpr, KMAX: tl.constexpr,
    CP: tl.constexpr, UP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    xr = x_ptr + row * stride_x
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    # logit bias, then min_tokens bans, on the ids of this chunk (a bias of 0 is a free slot)
    j = tl.arange(0, WP)
    bid = tl.load(bias_id_ptr + slot * W + j, mask=j < W, other=-1).to(tl.int64)
    bval = tl.load(bias_val_ptr + slot * W + j, mask=j < W, other=0.0)
    mine = (bid >= start) & (bid < end) & (bval != 0.0)
    tl.store(xr + bid, tl.load(xr + bid, mask=mine, other=0.0) + bval, mask=mine)
    tl.debug_barrier()
    step = tl.load(step_ptr + slot)
    if step < tl.load(mint_ptr + slot):
        jb = tl.arange(0, BP)
        ban = tl.load(ban_ptr + slot * B + jb, mask=jb < B, other=-1).to(tl.int64)
        tl.store(xr + ban, float("-inf"), mask=(ban >= start) & (ban < end))
    tl.debug_barrier()
    offs = start + tl.arange(0, CHUNK)
    mask = offs < end
    v = tl.load(xr + offs, mask=mask, other=float("-inf"))
    if tl.load(pen_ptr + slot) != 0:
        rep = tl.load(rep_ptr + slot)
        cnt = tl.load(counts_ptr + slot * stride_c + offs, mask=mask, other=0)
        seen = (tl.load(seen_ptr + slot * stride_c + offs, mask=mask, other=0) != 0) | (cnt > 0)
        v = tl.where(seen, tl.where(v > 0, v / rep, v * rep), v)
        v = v - tl.load(freq_ptr + slot) * cnt.to(tl.float32)
        v = v - tl.load(pres_ptr + slot) * (cnt > 0).to(tl.float32)
        tl.store(xr + offs, v, mask=mask)
    m_c = tl.max(v, axis=0)
    tl.store(part_v_ptr + row * C + c, m_c)
    tl.store(part_i_ptr + row * C + c, tl.min(tl.where(v == m_c, offs, V), axis=0))
    temp = tl.load(temp_ptr + slot)
    top_k = tl.load(topk_ptr + slot)
    if (temp > 0) & (top_k > 0):
        packed = (zkey(v) << 32) | (0xFFFFFFFF - offs.to(tl.int64))
        packed = tl.where(mask, packed, MIN64)
        srt = tl.sort(packed, descending=True)
        r = tl.arange(0, CHUNK)
        tl.store(cand_ptr + (row * C + c) * KMAX + r, srt, mask=r < KMAX)
    if last_program(ticket_ptr, row, C):
        m, first = first_best(part_v_ptr, part_i_ptr, row * C, C, V, CP)
        tl.store(m_ptr + row, m)
        min_p = tl.load(minp_ptr + slot)
        floor = tl.where(min_p > 0, tl.log(tl.maximum(min_p, 1e-38)), float("-inf"))
        tl.store(lo_ptr + row, floor)
        if temp == 0:
            finish(row, slot, first, out_ptr, live_ptr, frozen, step_ptr, counts_ptr, stride_c,
                   status_ptr)  # fmt: skip
        elif top_k > 0:
            tok = _resolve_top_k(
                x_ptr, stride_x, V, row, slot, m, temp, top_k, tl.load(topp_ptr + slot), floor,
                cand_ptr, C, tl.load(seed_ptr + slot), step, KMAX, CP, UP,
            )  # fmt: skip
            if tok >= 0:
                finish(row, slot, tok, out_ptr, live_ptr, frozen, step_ptr, counts_ptr, stride_c,
                       status_ptr)  # fmt: skip
            else:
                tl.store(status_ptr + row, 2)
        else:
            tl.store(status_ptr + row, 0)
