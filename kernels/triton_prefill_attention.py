"""Packed variable-length causal prefill attention over the paged KV cache (flash-attention).

Grid (Hq, B, M-tiles), M-tiles in reverse so the longest causal rows start first. Each
program keeps one [BLOCK_M, D] query tile in registers and streams K/V tiles of BLOCK_N
positions gathered through the block table, with an online softmax (fp32, exp2 domain).
Query row i of sequence b sits at absolute position prefix_b + i, prefix_b = context_lens[b]
- q_len_b (chunked prefill: the cached prefix is attended like any other key). Keys below
the tile's first position are visible to every row, so that part of the loop runs without
causal masks; only the last few tiles along the diagonal are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import dot, dot_flags, interpreting, load_rows, pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _tile(
    acc,
    m_i,
    l_i,
    q,
    start,
    k_base,
    v_base,
    bt_row,
    pos_m,
    hi,
    qk_scale,
    s_kb,
    s_ks,
    s_vb,
    s_vs,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tok = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = tok < hi
    if MASKED:
        blk = tl.load(bt_row + tok // BS, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + tok // BS).to(tl.int64)
    slot = tok % BS
    k = load_rows(
        k_base + blk[:, None] * s_kb + slot[:, None] * s_ks + offs_d[None, :],
        n_mask,
        offs_d,
        D,
        BLOCK_D,
        MASKED,
    )
    s = dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE, UPCAST) * qk_scale
    if MASKED:
        s = tl.where((tok[None, :] <= pos_m[:, None]) & n_mask[None, :], s, float("-inf"))
    # Every row has a visible key in the first tile it sees, so m_new is finite from then on.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = load_rows(
        v_base + blk[:, None] * s_vb + slot[:, None] * s_vs + offs_d[None, :],
        n_mask,
        offs_d,
        D,
        BLOCK_D,
        MASKED,
    )
    acc = dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cu_ptr,
    lens_ptr,
    out_ptr,
    qk_scale,
    s_qt,
    s_qh,
    s_kb,
    s_ks,
    s_kh,
    s_vb,
    s_vs,
    s_vh,
    s_bt,
    s_ot,
    s_oh,
    max_blocks,
    QG: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    m0 = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    q_lo = tl.load(cu_ptr + b).to(tl.int64)
    q_len = (tl.load(cu_ptr + b + 1) - q_lo).to(tl.int32)
    if m0 >= q_len:
        return
    ctx = tl.minimum(tl.load(lens_ptr + b), max_blocks * BS)
    prefix = ctx - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    q = tl.load(
        q_ptr + (q_lo + offs_m)[:, None] * s_qt + h * s_qh + offs_d[None, :],
        mask=m_mask[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    kvh = h // QG
    k_base = k_ptr + kvh * s_kh
    v_base = v_ptr + kvh * s_vh
    bt_row = bt_ptr + b * s_bt
    pos_m = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end = ((prefix + m0 + 1) // BLOCK_N) * BLOCK_N  # keys < full_end: visible to all rows
    hi = tl.minimum(ctx, prefix + tl.minimum(m0 + BLOCK_M, q_len))
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _tile(
            acc,
            m_i,
            l_i,
            q,
            start,
            k_base,
            v_base,
            bt_row,
            pos_m,
            hi,
            qk_scale,
            s_kb,
            s_ks,
            s_vb,
            s_vs,
            D,
            BLOCK_D,
            BS,
            BLOCK_M,
            BLOCK_N,
            False,
            IEEE,
            UPCAST,
        )
    for start in range(tl.maximum(full_end, 0), hi, BLOCK_N):
        acc, m_i, l_i = _tile(
            acc,
            m_i,
            l_i,
            q,
            start,
            k_base,
            v_base,
            bt_row,
            pos_m,
            hi,
            qk_scale,
            s_kb,
            s_ks,
            s_vb,
            s_vs,
            D,
            BLOCK_D,
            BS,
            BLOCK_M,
            BLOCK_N,
            True,
            IEEE,
            UPCAST,
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_lo + offs_m)[:, None] * s_ot + h * s_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & (offs_d[None, :] < D),
    )


def _config(d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), sized so Q + staged K/V fit in shared memory."""
    if interpreting():
        return 16, 16, 4, 1
    if dtype == torch.float32:  # test-only precision path: 4-byte tiles
        return (32, 32, 4, 2) if d >= 256 else (64, 32, 4, 2)
    if d <= 64:
        return 128, 64, 4, 3
    if d <= 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 2  # D=256: 8 warps keep the [64, 256] fp32 accumulator out of local memory


def prefill_attention_impl(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    max_query_len: int,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`block_m` / `block_n` override the tile sizes (tests use this); `out` (q's shape and
    dtype, unit last stride) receives the result when given."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "KV cache needs a unit last stride"
    assert hq % hkv == 0, f"q heads {hq} not a multiple of kv heads {hkv}"
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    batch = block_tables.shape[0]
    if num_t == 0 or batch == 0 or max_query_len <= 0:
        return out
    bm, bn, warps, stages = _config(d, q.dtype)
    bm, bn = block_m or bm, block_n or bn
    grid = (hq, batch, triton.cdiv(int(max_query_len), bm))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        block_tables.shape[1],
        QG=hq // hkv,
        D=d,
        BLOCK_D=pow2(d),
        BS=bs,
        BLOCK_M=bm,
        BLOCK_N=bn,
        **dot_flags(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out


def prefill_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    max_query_len: int,
    scale: float,
    out=None,
) -> torch.Tensor:
    return prefill_attention_impl(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len, scale, out=out
    )
