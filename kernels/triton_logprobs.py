"""Raw logprobs on the device (engine/sampling_math.raw_logprobs is the torch twin): log-sum-exp,
the sampled token's logprob and the top-N (N = the buffers' width, 20), in two passes of one
program per row chunk, no vocabulary sort and no copy of the logits.

    stats  each chunk: its max, its sum of exp(x - max) and the max of each of its sub-blocks;
           the row's last program: lse, and the N-th largest sub-block max as a lower bound on
           the N-th largest logit (N sub-blocks hold a logit at least that large). In a sampling
           step this runs inside the sampler's first pass (kernels/triton_sampling_prep.py), on
           the chunk it has just loaded and before it applies bias, bans or penalties; a chunk
           that pass changes is first saved to a side buffer (flag `mod`), the others are
           read from the logits themselves.
    top    each chunk appends its logits >= the bound to the row's list (one atomic per
           logit listed); the last program sorts the list (its order does not matter), writes the top
           N (ties: lower id first) and the sampled token's logprob. A row whose list
           overflows (a near-constant row) takes N exact passes instead, in that program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import pow2
from splitserve.kernels.triton_sampling_common import last_program, sorted_list, unkey, zkey

MIN64: tl.constexpr = tl.constexpr(-9223372036854775808)
CHUNK, SUB, CAP = 4096, 128, 1024


@triton.jit
def chunk_stats(v, row, c, C, part_m_ptr, part_s_ptr, submax_ptr, CHUNK: tl.constexpr,
                NSUB: tl.constexpr):  # fmt: skip
    """Stores chunk c's max, sum of exp(v - max) and sub-block maxima of raw logits v [CHUNK]."""
    m_c = tl.max(v, axis=0)
    tl.store(part_m_ptr + row * C + c, m_c)
    tl.store(part_s_ptr + row * C + c, tl.sum(tl.exp(v - m_c), axis=0))
    sub = tl.max(tl.reshape(v, [NSUB, CHUNK // NSUB]), axis=1)
    tl.store(submax_ptr + (row * C + c) * NSUB + tl.arange(0, NSUB), sub)


@triton.jit
def row_stats(row, C, part_m_ptr, part_s_ptr, submax_ptr, lse_ptr, bound_ptr, NTOP: tl.constexpr,
              NSUB: tl.constexpr, CP: tl.constexpr, SP: tl.constexpr):  # fmt: skip
    """The row's last program: lse and the top list's lower bound from the chunks' stats."""
    cs = tl.arange(0, CP)
    ms = tl.load(part_m_ptr + row * C + cs, mask=cs < C, other=float("-inf"), cache_modifier=".cg")
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
    chunk_stats(v, row, c, C, part_m_ptr, part_s_ptr, submax_ptr, CHUNK, NSUB)
    if last_program(ticket_ptr, row, C):
        row_stats(row, C, part_m_ptr, part_s_ptr, submax_ptr, lse_ptr, bound_ptr, NTOP, NSUB,
                  CP, SP)  # fmt: skip


@triton.jit
def _raw_chunk(xr, side_r, mod_ptr, row, C, c, SIDE: tl.constexpr):
    """Where chunk c of the row's raw logits is: the logits, or the side buffer when the
    sampler's first pass changed that chunk."""
    src = xr
    if SIDE:
        if tl.load(mod_ptr + row * C + c) != 0:
            src = side_r
    return src


@triton.jit
def _emit_top(srt, lse, top_ptr, top_id_ptr, row, NTOP: tl.constexpr, S: tl.constexpr):
    """The first NTOP entries of a sorted packed list: logprob (value - lse) and id, stored
    straight from the sorted block."""
    u = tl.arange(0, S)
    tl.store(top_ptr + row * NTOP + u, unkey(srt >> 32) - lse, mask=u < NTOP)
    tl.store(top_id_ptr + row * NTOP + u, 0xFFFFFFFF - (srt & 0xFFFFFFFF), mask=u < NTOP)


@triton.jit
def _top_kernel(
    x_ptr, stride_x, V, slot_ptr, want_ptr, tok_ptr, lse_ptr, bound_ptr, count_ptr, list_ptr, ticket_ptr,
    sampled_ptr, top_ptr, top_id_ptr, side_ptr, mod_ptr, C,
    NTOP: tl.constexpr, CHUNK: tl.constexpr, CAP: tl.constexpr, SIDE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if tl.load(want_ptr + tl.load(slot_ptr + row)) == 0:
        return
    xr = x_ptr + row * stride_x
    side_r = side_ptr + row * V
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    v = tl.load(
        _raw_chunk(xr, side_r, mod_ptr, row, C, c, SIDE) + offs, mask=mask, other=float("-inf")
    )
    sel = mask & (v >= tl.load(bound_ptr + row))
    # a slot per selected logit (few per chunk: one atomic each, no scan of the chunk)
    pos = tl.atomic_add(count_ptr + row + tl.zeros_like(offs), 1, mask=sel, sem="relaxed")
    packed = (zkey(v) << 32) | (0xFFFFFFFF - offs.to(tl.int64))
    tl.store(list_ptr + row * CAP + pos, packed, mask=sel & (pos < CAP))
    if last_program(ticket_ptr, row, C):
        lse = tl.load(lse_ptr + row)
        tok = tl.load(tok_ptr + row)
        src = _raw_chunk(xr, side_r, mod_ptr, row, C, tok // CHUNK, SIDE)
        tl.store(sampled_ptr + row, tl.load(src + tok) - lse)
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
                for cc in range(0, C):
                    idx = cc * CHUNK + tl.arange(0, CHUNK)
                    src = _raw_chunk(xr, side_r, mod_ptr, row, C, cc, SIDE)
                    w = tl.load(src + idx, mask=idx < V, other=float("-inf"))
                    pk = (zkey(w) << 32) | (0xFFFFFFFF - idx.to(tl.int64))
                    pk = tl.where((idx < V) & (pk < prev), pk, MIN64)
                    top = tl.maximum(top, pk)
                prev = tl.max(top, axis=0)
                tl.store(top_ptr + row * NTOP + k, unkey(prev >> 32) - lse)
                tl.store(top_id_ptr + row * NTOP + k, 0xFFFFFFFF - (prev & 0xFFFFFFFF))


@dataclass
class LogprobScratch:
    """Device scratch of one step's raw logprobs for n rows of V logits: the stats pass's
    partials and results, the side buffer of changed chunks, the top pass's lists."""

    chunk: int
    chunks: int
    nsub: int
    ntop: int
    part_m: torch.Tensor
    part_s: torch.Tensor
    submax: torch.Tensor
    lse: torch.Tensor
    bound: torch.Tensor
    side: torch.Tensor
    mod: torch.Tensor

    @classmethod
    def empty(
        cls, n: int, vocab: int, ntop: int, device, side: bool, chunk: int | None = None,
        sub: int | None = None,
    ) -> LogprobScratch:  # fmt: skip
        """`side`: room for changed chunks (a sampling step); chunk / sub: the sampler's split."""
        chunk = chunk or min(CHUNK, pow2(vocab))
        c = -(-vocab // chunk)
        nsub = max(1, chunk // (sub or SUB))
        f32 = torch.float32
        e = lambda *shape: torch.empty(*shape, dtype=f32, device=device)  # noqa: E731
        mod = torch.zeros(n, c, dtype=torch.int32, device=device)
        side_buf = e(n, vocab) if side else e(1)
        return cls(chunk, c, nsub, ntop, e(n, c), e(n, c), e(n, c, nsub), e(n), e(n), side_buf, mod)


def top_pass(logits, tokens, sampled, top, top_ids, slots, wants, lp: LogprobScratch, side: bool):
    """The top pass over the rows whose stats pass has run (lp holds its results)."""
    n, vocab = logits.shape
    count = torch.zeros(n, dtype=torch.int32, device=logits.device)
    listed = torch.empty(n, CAP, dtype=torch.int64, device=logits.device)
    ticket = torch.zeros(n, dtype=torch.int32, device=logits.device)
    _top_kernel[(n, lp.chunks)](
        logits, logits.stride(0), vocab, slots, wants, tokens, lp.lse, lp.bound, count, listed,
        ticket, sampled, top, top_ids, lp.side, lp.mod, lp.chunks,
        NTOP=lp.ntop, CHUNK=lp.chunk, CAP=CAP, SIDE=side, num_warps=8,
    )  # fmt: skip


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
    if n == 0:
        return
    lp = LogprobScratch.empty(n, vocab, top.shape[1], logits.device, side=False)
    c = lp.chunks
    ticket = torch.zeros(n, dtype=torch.int32, device=logits.device)
    _stats_kernel[(n, c)](
        logits, logits.stride(0), vocab, slots, wants, lp.part_m, lp.part_s, lp.submax, lp.lse,
        lp.bound, ticket, c, NTOP=lp.ntop, CHUNK=lp.chunk, NSUB=lp.nsub, CP=pow2(c),
        SP=pow2(c * lp.nsub), num_warps=8,
    )  # fmt: skip
    top_pass(logits, tokens, sampled, top, top_ids, slots, wants, lp, side=False)
