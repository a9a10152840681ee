"""Pass 1 of the sampler (kernels/triton_sampling.py): logits processing, the row max, greedy
rows done.

Program (row, c) owns chunk c of the row. It loads the raw chunk (in a step that reports
logprobs, the rows that asked take their raw stats from it here, triton_logprobs.chunk_stats,
and a chunk about to change is saved to the side buffer first); applies the row's logit bias
and min_tokens bans that fall in its chunk, when there are any (stores, a barrier, the chunk
read again); the penalties (in place: the later passes read the processed logits); and stores
the chunk's max and its first index; a top-k row also stores the max of each of its chunk's
NSUB sub-blocks. The last program of the row (triton_sampling_common.last_program) reduces
the row max m and its first index: a greedy row is finished with it; a top-k row takes the
k-th largest sub-block max as a lower bound on its k-th largest token (k sub-blocks hold a
token at least that large) and goes to the compaction (status 4; status 2, the radix select,
when k exceeds the sub-blocks); any other random row goes to the race (status 0). Every
random row's lower bound on z = (x - m) / T starts at its min-p floor.
"""

from __future__ import annotations

import triton
import triton.language as tl

from splitserve.kernels.triton_logprobs import chunk_stats, row_stats
from splitserve.kernels.triton_sampling_common import finish, first_best, last_program


@triton.jit
def prep_kernel(
    x_ptr, stride_x, V, slot_ptr, live_ptr, out_ptr, frozen,
    temp_ptr, topk_ptr, minp_ptr, step_ptr, mint_ptr,
    pen_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr, seen_ptr, stride_c,
    bias_id_ptr, bias_val_ptr, W, ban_ptr, B,
    part_v_ptr, part_i_ptr, ticket_ptr, m_ptr, status_ptr, lo_ptr, krem_ptr, prefix_ptr,
    submax_ptr, zt_ptr, C,
    want_ptr, lp_m_ptr, lp_s_ptr, lp_sub_ptr, lse_ptr, bound_ptr, side_ptr, mod_ptr,
    CHUNK: tl.constexpr, WP: tl.constexpr, BP: tl.constexpr, CP: tl.constexpr,
    NSUB: tl.constexpr, SP: tl.constexpr, LOGPROBS: tl.constexpr, NTOP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    xr = x_ptr + row * stride_x
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    offs = start + tl.arange(0, CHUNK)
    mask = offs < end
    v = tl.load(xr + offs, mask=mask, other=float("-inf"))  # raw
    # this chunk's logit bias (a bias of 0 is a free slot) and, before min_tokens, its bans
    j = tl.arange(0, WP)
    bid = tl.load(bias_id_ptr + slot * W + j, mask=j < W, other=-1).to(tl.int64)
    bval = tl.load(bias_val_ptr + slot * W + j, mask=j < W, other=0.0)
    mine = (bid >= start) & (bid < end) & (bval != 0.0)
    jb = tl.arange(0, BP)
    ban = tl.load(ban_ptr + slot * B + jb, mask=jb < B, other=-1).to(tl.int64)
    ban_end = tl.where(tl.load(step_ptr + slot) < tl.load(mint_ptr + slot), end, start)
    banned = (ban >= start) & (ban < ban_end)  # none once min_tokens is reached
    in_memory = (tl.sum(mine.to(tl.int32), axis=0) + tl.sum(banned.to(tl.int32), axis=0)) > 0
    pen = tl.load(pen_ptr + slot) != 0
    if LOGPROBS:  # raw stats (triton_logprobs.py) of the rows that asked, before any change
        if tl.load(want_ptr + slot) != 0:
            chunk_stats(v, row, c, C, lp_m_ptr, lp_s_ptr, lp_sub_ptr, CHUNK, NSUB)
            changed = in_memory | pen
            if changed:  # the top pass reads this chunk's raw logits from the side buffer
                tl.store(side_ptr + row * V + offs, v, mask=mask)
            tl.store(mod_ptr + row * C + c, changed.to(tl.int32))
    if in_memory:  # bias, then bans, in memory (stores, a barrier, the chunk read again)
        tl.debug_barrier()
        tl.store(xr + bid, tl.load(xr + bid, mask=mine, other=0.0) + bval, mask=mine)
        tl.debug_barrier()
        tl.store(xr + ban, float("-inf"), mask=banned)
        tl.debug_barrier()
        v = tl.load(xr + offs, mask=mask, other=float("-inf"))
    if pen:
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
    if (temp > 0) & (top_k > 0):  # sub-block maxima: a cheap lower bound on the k-th largest
        sub = tl.max(tl.reshape(v, [NSUB, CHUNK // NSUB]), axis=1)
        tl.store(submax_ptr + (row * C + c) * NSUB + tl.arange(0, NSUB), sub)
    if last_program(ticket_ptr, row, C):
        m, first = first_best(part_v_ptr, part_i_ptr, row * C, C, V, CP)
        tl.store(m_ptr + row, m)
        if LOGPROBS:
            if tl.load(want_ptr + slot) != 0:
                row_stats(row, C, lp_m_ptr, lp_s_ptr, lp_sub_ptr, lse_ptr, bound_ptr, NTOP, NSUB,
                          CP, SP)  # fmt: skip
        min_p = tl.load(minp_ptr + slot)
        floor = tl.where(min_p > 0, tl.log(tl.maximum(min_p, 1e-38)), float("-inf"))
        tl.store(lo_ptr + row, floor)
        if temp == 0:
            finish(row, slot, first, out_ptr, live_ptr, frozen, step_ptr, counts_ptr, stride_c,
                   status_ptr)  # fmt: skip
        elif top_k > 0:  # the k-th largest z: triton_sampling_topk.py
            tl.store(krem_ptr + row, top_k)
            tl.store(prefix_ptr + row, 0)
            tl.store(status_ptr + row, 2)  # radix select, unless the bound below applies
            if top_k <= C * NSUB:  # k sub-blocks reach the k-th sub-block max: >= k tokens
                u = tl.arange(0, SP)
                sub = tl.load(
                    submax_ptr + row * C * NSUB + u, mask=u < C * NSUB, other=float("-inf"),
                    cache_modifier=".cg",
                )  # fmt: skip
                kth = tl.max(
                    tl.where(u == top_k - 1, tl.sort(sub, descending=True), float("-inf")), axis=0
                )
                tl.store(zt_ptr + row, (kth - m) * (1.0 / temp))
                tl.store(status_ptr + row, 4)
        else:
            tl.store(status_ptr + row, 0)
