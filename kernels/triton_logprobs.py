"""Raw logprobs on the device (engine/sampling_math.raw_logprobs is the torch twin): log-sum-exp,
the sampled token's logprob and the top-N (N = the buffers' width, 20), in two passes of one
program per row chunk, no vocabulary sort.

    stats  each chunk: its max, its sum of exp(x - max) and the max of each of its sub-blocks;
           the row's last program: lse, and the N-th largest sub-block max as a lower bound on
           the N-th largest logit (N sub-blocks hold a logit at least that large)
    top    each chunk appends its logits >= the bound to the row's list (one atomic per
           logit listed); the last program sorts the list (its order does not matter), writes the top
           N (ties: lower id first) and the sampled token's logprob. A row whose list
           overflows (a near-constant row) takes N exact passes instead, in that program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import pow2
from splitserve.kernels.triton_sampling_common import last_program, sorted_list, unkey, zkey

MIN64: tl.constexpr = tl.constexpr(-9223372036854775808)
CHUNK, SUB, CAP = 4096, 128, 1024


@triton.jit
def _stats_kernel(
    x_ptr, stride_x, V, slot_ptr, want_ptr, part_m_ptr, part_s_ptr, submax_ptr, lse_ptr, bound_ptr, ticket_ptr, C,
    NTOP: tl.constexpr, CHUNK: tl.constexpr, NSUB: tl.constexpr, CP: tl.constexpr,
    SP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if tl.load(want_ptr + tl.load(slot_ptr + row)) == 0:  # the row asked for no logprobs
        return
    offs = c * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf"))
    m_c = tl.max(v, axis=0)
    tl.store(part_m_ptr + row * C + c, m_c)
    tl.store(part_s_ptr + row * C + c, tl.sum(tl.exp(v - m_c), axis=0))
    sub = tl.max(tl.reshape(v, [NSUB, CHUNK // NSUB]), axis=1)
    tl.store(submax_ptr + (row * C + c) * NSUB + tl.arange(0, NSUB), sub)
    if last_program(ticket_ptr, row, C):
        cs = tl.arange(0, CP)
        ms = tl.load(
            part_m_ptr + row * C + cs, mask=cs < C, other=float("-inf"), cache_modifier=".cg"
        )
        ss = tl.load(part_s_ptr + row * C + cs, mask=cs < C, other=0.0, cache_modifier=".cg")
        big = tl.max(ms, axis=0)
        tl.store(lse_ptr + row, big + tl.log(tl.sum(ss * tl.exp(ms - big), axis=0)))
        u = tl.arange(0, SP)
        subs = tl.load(
            submax_ptr + row * C * NSUB + u, mask=u < C * NSUB, other=float("-inf"),
            cache_modifier=".cg",
        )  # fmt: skip
        nth = tl.max(tl.where(u == NTOP - 1, tl.sort(subs, descending=True), float("-inf")), axis=0)
        tl.store(bound_ptr + row, nth)


@triton.jit
def _emit_top(srt, lse, top_ptr, top_id_ptr, row, NTOP: tl.constexpr, S: tl.constexpr):
    """The first NTOP entries of a sorted packed list: logprob (value - lse) and id."""
    u = tl.arange(0, S)
    for k in tl.static_range(NTOP):
        p = tl.max(tl.where(u == k, srt, MIN64), axis=0)
        tl.store(top_ptr + row * NTOP + k, unkey(p >> 32) - lse)
        tl.store(top_id_ptr + row * NTOP + k, 0xFFFFFFFF - (p & 0xFFFFFFFF))


@triton.jit
def _top_kernel(
    x_ptr, stride_x, V, slot_ptr, want_ptr, tok_ptr, lse_ptr, bound_ptr, count_ptr, list_ptr, ticket_ptr,
    sampled_ptr, top_ptr, top_id_ptr, C,
    NTOP: tl.constexpr, CHUNK: tl.constexpr, CAP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if tl.load(want_ptr + tl.load(slot_ptr + row)) == 0:
        return
    xr = x_ptr + row * stride_x
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    v = tl.load(xr + offs, mask=mask, other=float("-inf"))
    sel = mask & (v >= tl.load(bound_ptr + row))
    # a slot per selected logit (few per chunk: one atomic each, no scan of the chunk)
    pos = tl.atomic_add(count_ptr + row + tl.zeros_like(offs), 1, mask=sel, sem="relaxed")
    packed = (zkey(v) << 32) | (0xFFFFFFFF - offs.to(tl.int64))
    tl.store(list_ptr + row * CAP + pos, packed, mask=sel & (pos < CAP))
    if last_program(ticket_ptr, row, C):
        lse = tl.load(lse_ptr + row)
        tl.store(sampled_ptr + row, tl.load(xr + tl.load(tok_ptr + row)) - lse)
        total = tl.atomic_add(count_ptr + row, 0)
        if (total <= 128) & (total <= CAP):  # the usual case: a short list, sorted in a small block
            _emit_top(sorted_list(list_ptr + row * CAP, total, 128), lse, top_ptr, top_id_ptr,
                      row, NTOP, 128)  # fmt: skip
        elif total <= CAP:
            _emit_top(sorted_list(list_ptr + row * CAP, total, CAP), lse, top_ptr, top_id_ptr,
                      row, NTOP, CAP)  # fmt: skip
        else:  # near-constant row: N passes, each the best entry below the previous one
            prev = tl.full((), 9223372036854775807, tl.int64)
            for k in range(NTOP):
                top = tl.full([CHUNK], MIN64, tl.int64)
                for start in range(0, V, CHUNK):
                    idx = start + tl.arange(0, CHUNK)
                    w = tl.load(xr + idx, mask=idx < V, other=float("-inf"))
                    pk = (zkey(w) << 32) | (0xFFFFFFFF - idx.to(tl.int64))
                    pk = tl.where((idx < V) & (pk < prev), pk, MIN64)
                    top = tl.maximum(top, pk)
                prev = tl.max(top, axis=0)
                tl.store(top_ptr + row * NTOP + k, unkey(prev >> 32) - lse)
                tl.store(top_id_ptr + row * NTOP + k, 0xFFFFFFFF - (prev & 0xFFFFFFFF))


def raw_logprobs_device(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    sampled: torch.Tensor,
    top: torch.Tensor,
    top_ids: torch.Tensor,
    slots: torch.Tensor,
    wants: torch.Tensor,
) -> None:
    """sampled [n], top [n, N], top_ids [n, N] of the raw fp32 logits [n, V] (N <= V), for the
    rows whose state slot wants them (wants[slots[r]] != 0; the others are left as they are)."""
    n, vocab = logits.shape
    ntop = top.shape[1]
    if n == 0:
        return
    dev, f32 = logits.device, torch.float32
    chunk = min(CHUNK, pow2(vocab))
    c = -(-vocab // chunk)
    nsub = max(1, chunk // SUB)
    ticket = torch.zeros(n, dtype=torch.int32, device=dev)
    lse, bound = torch.empty(n, dtype=f32, device=dev), torch.empty(n, dtype=f32, device=dev)
    part_m, part_s = (
        torch.empty(n, c, dtype=f32, device=dev),
        torch.empty(n, c, dtype=f32, device=dev),
    )
    submax = torch.empty(n, c, nsub, dtype=f32, device=dev)
    _stats_kernel[(n, c)](
        logits, logits.stride(0), vocab, slots, wants, part_m, part_s, submax, lse, bound, ticket, c,
        NTOP=ntop, CHUNK=chunk, NSUB=nsub, CP=pow2(c), SP=pow2(c * nsub), num_warps=8,
    )  # fmt: skip
    count = torch.zeros(n, dtype=torch.int32, device=dev)
    listed = torch.empty(n, CAP, dtype=torch.int64, device=dev)
    _top_kernel[(n, c)](
        logits, logits.stride(0), vocab, slots, wants, tokens, lse, bound, count, listed, ticket,
        sampled, top, top_ids, c, NTOP=ntop, CHUNK=chunk, CAP=CAP, num_warps=8,
    )  # fmt: skip
