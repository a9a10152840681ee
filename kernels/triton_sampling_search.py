"""The top-k / top-p thresholds of the sampler (kernels/triton_sampling.py), without a sort.

Per row, over the order-preserving integer key of z = (x - max) / T (computed once, with
exp(z), by the prep pass): a bracket [lo, hi) is narrowed 16-fold per round, each round one
pass whose programs split the row (partial counts / masses per chunk) and one small step
kernel that sums them and moves the bracket. The number of launches is fixed (9 rounds per
search, enough for a 2^33-wide bracket), so the whole search captures in a CUDA graph; a
row whose bracket has settled returns at once. top-k: the largest key with count(key >= t)
>= k; top-p: the smallest key with mass(key > t) < top_p * (mass kept by min-p and top-k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import pow2


@triton.jit
def key(z):
    """Order-preserving int64 key of float32 z."""
    bits = z.to(tl.float32).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _search_init_kernel(
    m_ptr, thr_ptr, lo_ptr, hi_ptr, slot_ptr, V, temp_ptr, topk_ptr, minp_ptr
):  # fmt: skip
    """thr = the min-p floor's key; the top-k search's bracket (inactive: hi = lo + 1)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    temp = tl.load(temp_ptr + slot)
    top_k = tl.load(topk_ptr + slot)
    min_p = tl.load(minp_ptr + slot)
    floor = tl.where(min_p > 0, tl.log(tl.maximum(min_p, 1e-38)), float("-inf")).to(tl.float32)
    tl.store(thr_ptr + row, key(floor))
    active = (temp > 0) & (top_k > 0) & (top_k < V)
    tl.store(lo_ptr + row, tl.cast(-2147483648, tl.int64))  # count(key >= lo) = V >= k
    tl.store(hi_ptr + row, tl.where(active, 1, -2147483647).to(tl.int64))  # z <= +0: key 0


@triton.jit
def _search_prep_kernel(
    x_ptr, stride_x, V, slot_ptr, m_ptr, key_ptr, e_ptr, C, CHUNK, temp_ptr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Chunk c of row r: key(z) and exp(z) of z = (x - max) / T, once, for the search passes."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    temp = tl.load(temp_ptr + slot)
    if temp > 0:
        xr = x_ptr + row * stride_x
        offs = tl.arange(0, BLOCK)
        m = tl.load(m_ptr + row)
        start0 = c * CHUNK
        end = tl.minimum(start0 + CHUNK, V)
        for start in range(start0, end, BLOCK):
            idx = start + offs
            mask = idx < end
            z = (tl.load(xr + idx, mask=mask, other=0.0) - m) / temp
            tl.store(key_ptr + row * V + idx, key(z).to(tl.int32), mask=mask)
            tl.store(e_ptr + row * V + idx, tl.exp(z), mask=mask)


@triton.jit
def _search_part_kernel(
    key_ptr, e_ptr, V, slot_ptr, thr_ptr, lo_ptr, hi_ptr, part_ptr, C, CHUNK, temp_ptr,
    MODE: tl.constexpr, BLOCK: tl.constexpr, NPIV: tl.constexpr,
):  # fmt: skip
    """Chunk c of row r, into part[r, c, :]: MODE 0 count(key >= pivot_j) (top-k), MODE 1
    mass(key > pivot_j) over key >= thr (top-p), MODE 2 the kept mass over key >= max(thr,
    lo) in column 0 (after top-k). Pivots split [lo, hi) in NPIV; a settled row does nothing."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    temp = tl.load(temp_ptr + slot)
    lo = tl.load(lo_ptr + row)
    hi = tl.load(hi_ptr + row)
    go = temp > 0
    if MODE != 2:
        go = go & (hi - lo > 1)
    if go:
        # loads are [BLOCK, 1] so the compare with the [1, NPIV] pivots broadcasts in registers
        offs = tl.arange(0, BLOCK)[:, None]
        j = tl.arange(0, NPIV)[None, :]
        thr = tl.load(thr_ptr + row)
        if MODE == 2:
            thr = tl.maximum(thr, lo)
        piv = lo + ((hi - lo) * j.to(tl.int64)) // NPIV
        acc = tl.zeros([BLOCK, NPIV], tl.float32)
        start0 = c * CHUNK
        end = tl.minimum(start0 + CHUNK, V)
        for start in range(start0, end, BLOCK):
            idx = start + offs
            mask = idx < end
            k = tl.load(key_ptr + row * V + idx, mask=mask, other=0).to(tl.int64)
            k = tl.where(mask, k, -2147483649)
            if MODE == 0:
                acc += (k >= piv).to(tl.float32)
            else:
                e = tl.load(e_ptr + row * V + idx, mask=mask & (k >= thr), other=0.0)
                if MODE == 1:
                    acc += tl.where(k > piv, e, 0.0)
                else:
                    acc += tl.where(j == 0, e, 0.0)
        tl.store(part_ptr + (row * C + c) * NPIV + tl.arange(0, NPIV), tl.sum(acc, axis=0))


@triton.jit
def _search_step_kernel(
    part_ptr, C, thr_ptr, lo_ptr, hi_ptr, target_ptr, slot_ptr, temp_ptr, topk_ptr, topp_ptr,
    MODE: tl.constexpr, CP: tl.constexpr, NPIV: tl.constexpr,
):  # fmt: skip
    """Sums the chunks' parts of row r and narrows its bracket (MODE 0 top-k, MODE 1 top-p), or
    (MODE 2) settles top-k into thr and opens the top-p bracket with its target mass."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    temp = tl.load(temp_ptr + slot)
    lo = tl.load(lo_ptr + row)
    hi = tl.load(hi_ptr + row)
    go = temp > 0
    if MODE != 2:
        go = go & (hi - lo > 1)
    if go:
        cs = tl.arange(0, CP)
        j = tl.arange(0, NPIV)
        parts = tl.load(
            part_ptr + (row * C + cs[:, None]) * NPIV + j[None, :], mask=cs[:, None] < C, other=0.0
        )
        tot = tl.sum(parts, axis=0)
        piv = lo + ((hi - lo) * j.to(tl.int64)) // NPIV
        if MODE == 0:
            top_k = tl.load(topk_ptr + slot).to(tl.float32)
            ok = tot >= top_k
        elif MODE == 1:
            ok = tot >= tl.load(target_ptr + row)
        if MODE != 2:
            new_lo = tl.max(tl.where(ok, piv, lo), axis=0)
            hi = tl.min(tl.where(ok, hi, piv), axis=0)
            lo = new_lo
            tl.store(lo_ptr + row, lo)
            tl.store(hi_ptr + row, hi)
            if (MODE == 1) & (hi - lo <= 1):
                tl.store(thr_ptr + row, tl.maximum(tl.load(thr_ptr + row), hi))
        else:
            thr = tl.maximum(tl.load(thr_ptr + row), lo)
            tl.store(thr_ptr + row, thr)
            top_p = tl.load(topp_ptr + slot)
            total = tl.sum(tl.where(j == 0, tot, 0.0), axis=0)
            tl.store(target_ptr + row, top_p * total)
            tl.store(lo_ptr + row, thr - 1)  # mass(key > lo) = total >= target
            tl.store(hi_ptr + row, tl.where(top_p < 1.0, 1, thr))  # inactive: hi = lo + 1


def thresholds(x, slots, m, c, chunk, block, state, filters: bool) -> torch.Tensor:
    """thr [n]: each row's lowest kept key (min-p, then top-k, then top-p), by bracket searches
    whose passes split each row over c programs; the launches are fixed (graph capture), a
    settled row's programs return at once."""
    n, vocab = x.shape
    s, dev = state, x.device
    npiv = 16
    iters = -(-33 // (npiv.bit_length() - 1))
    thr = torch.empty(n, dtype=torch.int64, device=dev)
    lo, hi = torch.empty_like(thr), torch.empty_like(thr)
    target = torch.zeros(n, dtype=torch.float32, device=dev)
    part = torch.empty(n, c, npiv, dtype=torch.float32, device=dev)
    _search_init_kernel[(n,)](m, thr, lo, hi, slots, vocab, s.temperature, s.top_k, s.min_p)
    blk = min(block, 256)
    if not filters:  # no row has top-k / top-p: the min-p floor is the threshold
        return thr

    keys = torch.empty(n, vocab, dtype=torch.int32, device=dev)
    e = torch.empty(n, vocab, dtype=torch.float32, device=dev)
    _search_prep_kernel[(n, c)](
        x, x.stride(0), vocab, slots, m, keys, e, c, chunk, s.temperature,
        BLOCK=block, num_warps=4,
    )  # fmt: skip

    def part_pass(mode: int) -> None:
        _search_part_kernel[(n, c)](
            keys, e, vocab, slots, thr, lo, hi, part, c, chunk, s.temperature,
            MODE=mode, BLOCK=blk, NPIV=npiv, num_warps=4,
        )  # fmt: skip

    def step(mode: int) -> None:
        _search_step_kernel[(n,)](
            part, c, thr, lo, hi, target, slots, s.temperature, s.top_k, s.top_p,
            MODE=mode, CP=pow2(c), NPIV=npiv, num_warps=4,
        )  # fmt: skip

    for mode, rounds in ((0, iters), (2, 1), (1, iters)):
        for _ in range(rounds):
            part_pass(mode)
            step(mode)
    return thr
