"""Pass 1 of the sampler (kernels/triton_sampling.py): logits processing, the row max, greedy
rows done.

Program (row, c) owns chunk c of the row: it applies the row's logit bias and min_tokens bans
that fall in its chunk (stores, then a barrier, then the chunk is read), the penalties (in
place: the later passes read the processed logits), and stores the chunk's max and its first
index. The last program of the row (triton_sampling_common.last_program) reduces the row max
m and its first index: a greedy row is finished with it; a top-k row goes to the radix select
(status 2), any other random row to the race (status 0), with the min-p floor as its lower
bound on z = (x - m) / T.
"""

from __future__ import annotations

import triton
import triton.language as tl

from splitserve.kernels.triton_sampling_common import finish, first_best, last_program


@triton.jit
def prep_kernel(
    x_ptr, stride_x, V, slot_ptr, live_ptr, out_ptr, frozen,
    temp_ptr, topk_ptr, minp_ptr, step_ptr, mint_ptr,
    pen_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr, seen_ptr, stride_c,
    bias_id_ptr, bias_val_ptr, W, ban_ptr, B,
    part_v_ptr, part_i_ptr, ticket_ptr, m_ptr, status_ptr, lo_ptr, krem_ptr, prefix_ptr, C,
    CHUNK: tl.constexpr, WP: tl.constexpr, BP: tl.constexpr, CP: tl.constexpr,
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
    if last_program(ticket_ptr, row, C):
        m, first = first_best(part_v_ptr, part_i_ptr, row * C, C, V, CP)
        tl.store(m_ptr + row, m)
        min_p = tl.load(minp_ptr + slot)
        floor = tl.where(min_p > 0, tl.log(tl.maximum(min_p, 1e-38)), float("-inf"))
        tl.store(lo_ptr + row, floor)
        top_k = tl.load(topk_ptr + slot)
        if tl.load(temp_ptr + slot) == 0:
            finish(row, slot, first, out_ptr, live_ptr, frozen, step_ptr, counts_ptr, stride_c,
                   status_ptr)  # fmt: skip
        elif top_k > 0:  # the radix select (triton_sampling_topk.py) finds the k-th largest
            tl.store(krem_ptr + row, top_k)
            tl.store(prefix_ptr + row, 0)
            tl.store(status_ptr + row, 2)
        else:
            tl.store(status_ptr + row, 0)
