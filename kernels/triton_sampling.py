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


@triton.jit
def _hash32(x):
    """lowbias32 on uint32 (wraps like the twin's int64 arithmetic masked to 32 bits)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _key(z):
    """Order-preserving int64 key of float32 z."""
    bits = z.to(tl.float32).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _pen_max_kernel(
    x_ptr, stride_x, V, slot_ptr, part_v_ptr, part_i_ptr, C, CHUNK,
    pen_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr, seen_ptr, stride_c,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Chunk c of row r: penalties in place (rows that have them), the chunk's max and first
    index of it into part_*[r, c]."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    xr = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    has_pen = tl.load(pen_ptr + slot)
    rep = tl.load(rep_ptr + slot)
    freq = tl.load(freq_ptr + slot)
    pres = tl.load(pres_ptr + slot)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int64)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        idx = start + offs
        mask = idx < hi
        v = tl.load(xr + idx, mask=mask, other=float("-inf"))
        if has_pen != 0:
            cnt = tl.load(counts_ptr + slot * stride_c + idx, mask=mask, other=0)
            s = tl.load(seen_ptr + slot * stride_c + idx, mask=mask, other=0)
            seen = (s != 0) | (cnt > 0)
            v = tl.where(seen, tl.where(v > 0, v / rep, v * rep), v)
            v = v - freq * cnt.to(tl.float32)
            v = v - pres * (cnt > 0).to(tl.float32)
            tl.store(xr + idx, v, mask=mask)
        better = v > best
        best_i = tl.where(better, idx.to(tl.int64), best_i)
        best = tl.where(better, v, best)
    m = tl.max(best, axis=0)
    tl.store(part_v_ptr + row * C + c, m)
    tl.store(part_i_ptr + row * C + c, tl.min(tl.where(best == m, best_i, V), axis=0))


_INT_MIN = -2147483648


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
    tl.store(thr_ptr + row, _key(floor))
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
            tl.store(key_ptr + row * V + idx, _key(z).to(tl.int32), mask=mask)
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


def _thresholds(x, slots, m, c, chunk, block, state, filters: bool) -> torch.Tensor:
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


@triton.jit
def _race_kernel(
    x_ptr, stride_x, V, slot_ptr, m_ptr, thr_ptr, part_v_ptr, part_i_ptr, C, CHUNK,
    temp_ptr, seed_ptr, step_ptr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Chunk c of row r: the best kept z + Gumbel(seed, step, token) and its first index."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    temp = tl.load(temp_ptr + slot)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int64)
    if temp > 0:
        xr = x_ptr + row * stride_x
        offs = tl.arange(0, BLOCK)
        m = tl.load(m_ptr + row)
        thr = tl.load(thr_ptr + row)
        seed = tl.load(seed_ptr + slot)
        step = tl.load(step_ptr + slot)
        seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        b = _hash32(seed_lo ^ _hash32(seed_hi ^ 0x243F6A88))
        k1 = _hash32((step & 0xFFFFFFFF).to(tl.uint32) ^ b ^ 0x85A308D3)
        k2 = _hash32(k1 ^ 0x13198A2E)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            mask = idx < hi
            z = (tl.load(xr + idx, mask=mask, other=0.0) - m) / temp
            h = _hash32(_hash32(idx.to(tl.uint32) + k1) ^ k2)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = tl.where(mask & (_key(z) >= thr), z - tl.log(-tl.log(u)), float("-inf"))
            better = score > best
            best_i = tl.where(better, idx.to(tl.int64), best_i)
            best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    tl.store(part_v_ptr + row * C + c, top)
    tl.store(part_i_ptr + row * C + c, tl.min(tl.where(best == top, best_i, V), axis=0))


def _chunks(vocab: int, block: int) -> tuple[int, int]:
    """Programs per row (each a whole number of blocks, about 4 blocks each): a function of the
    vocabulary only, never of the batch, so the float sums of the top-p search add up in the
    same order whatever a row's batch and a seeded row's token does not depend on it."""
    c = max(1, vocab // (4 * block))
    chunk = -(-vocab // c)
    chunk = -(-chunk // block) * block
    return -(-vocab // chunk), chunk


def _reduce(part_v: torch.Tensor, part_i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max over chunks and the first index of it (chunks are in token order)."""
    which = part_v.argmax(dim=1, keepdim=True)
    return part_v.gather(1, which).squeeze(1), part_i.gather(1, which).squeeze(1)


def sample_rows(
    x: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, state, filters: bool = True
) -> None:
    """out[r] = token of row r of the fp32 logits x [n, V] (penalties applied to x in place),
    with the parameters of state slot slots[r]; `state` holds the per-slot tensors
    (engine/sampling_state.py). filters=False: no row has top-k / top-p (their searches
    are not launched)."""
    n, vocab = x.shape
    if n == 0:
        return
    block = min(pow2(vocab), 64 if interpreting() else 1024)
    c, chunk = _chunks(vocab, block)
    s = state
    part_v = torch.empty(n, c, dtype=torch.float32, device=x.device)
    part_i = torch.empty(n, c, dtype=torch.int64, device=x.device)
    _pen_max_kernel[(n, c)](
        x, x.stride(0), vocab, slots, part_v, part_i, c, chunk,
        s.has_pen, s.rep, s.freq, s.pres, s.counts, s.prompt_seen, s.counts.stride(0),
        BLOCK=block, num_warps=4,
    )  # fmt: skip
    m, first = _reduce(part_v, part_i)
    thr = _thresholds(x, slots, m, c, chunk, block, s, filters)
    _race_kernel[(n, c)](
        x, x.stride(0), vocab, slots, m, thr, part_v, part_i, c, chunk,
        s.temperature, s.seed, s.step,
        BLOCK=block, num_warps=4,
    )  # fmt: skip
    _, raced = _reduce(part_v, part_i)
    random = s.temperature.index_select(0, slots) > 0
    out.copy_(torch.where(random, raced, first))
