"""Paged decode attention (one query token per sequence), split-KV / flash-decoding.

Grid (B, Hkv, S): each program takes all QG = Hq/Hkv query heads of one KV head (GQA: the
K/V tile is read once for the whole group; the group is padded to >= 16 rows for tl.dot) and
every S-th tile of BLOCK_N KV positions, starting at tile `split`. Interleaving the tiles
(instead of giving each split a contiguous range of the block table's width) spreads the
*actual* context over all splits, so a graph captured for a long max context still fills the
GPU when the live contexts are short. A second kernel merges the S partial results with
their log-sum-exp weights; with S == 1 the partial kernel writes the output directly.

CUDA-graph safety: S and the grid come only from tensor shapes (batch, block_tables width)
and the SM count; context_lens is read only on the device. A lane with context_len 0 reads
no K/V and outputs zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import dot, dot_flags, interpreting, load_rows, pow2, sm_count

_LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 128  # shorter splits cost more in reduce traffic and launch than they gain
MAX_SPLITS = 64


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    po_ptr,
    plse_ptr,
    qk_scale,
    s_qb,
    s_qh,
    s_kb,
    s_ks,
    s_kh,
    s_vb,
    s_vs,
    s_vh,
    s_bt,
    s_ob,
    s_oh,
    max_blocks,
    QG: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Clamp to what the block table can address: never read past it, whatever the lengths say.
    ctx = tl.minimum(tl.maximum(tl.load(lens_ptr + b), 0), max_blocks * BS)
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    if NUM_SPLITS > 1:
        if split >= n_tiles:  # nothing here; the reduce kernel skips this split (it knows ctx too)
            return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * QG + offs_g
    g_mask = offs_g < QG
    d_mask = offs_d < D
    q = tl.load(
        q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    k_base = k_ptr + kvh * s_kh
    v_base = v_ptr + kvh * s_vh
    bt_row = bt_ptr + b * s_bt

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(split, n_tiles, NUM_SPLITS):
        tok = tile * BLOCK_N + offs_n
        n_mask = tok < ctx
        blk = tl.load(bt_row + tok // BS, mask=n_mask, other=0).to(tl.int64)
        slot = tok % BS
        k = load_rows(
            k_base + blk[:, None] * s_kb + slot[:, None] * s_ks + offs_d[None, :],
            n_mask,
            offs_d,
            D,
            BLOCK_D,
            True,
        )
        s = dot(q, tl.trans(k), tl.zeros([BLOCK_G, BLOCK_N], tl.float32), IEEE, UPCAST) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has >= 1 valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = load_rows(
            v_base + blk[:, None] * s_vb + slot[:, None] * s_vs + offs_d[None, :],
            n_mask,
            offs_d,
            D,
            BLOCK_D,
            True,
        )
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, UPCAST)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # ctx 0 -> zeros
        tl.store(
            out_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # partials: po [B, Hq, S, D] fp32, plse [B, Hq, S] fp32 (log2 domain)
        row = (b * (tl.num_programs(1) * QG) + heads) * NUM_SPLITS + split
        tl.store(
            po_ptr + row[:, None] * D + offs_d[None, :],
            acc / l_i[:, None],
            mask=g_mask[:, None] & d_mask[None, :],
        )
        tl.store(plse_ptr + row, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    po_ptr,
    plse_ptr,
    lens_ptr,
    out_ptr,
    s_ob,
    s_oh,
    max_blocks,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ctx = tl.minimum(tl.maximum(tl.load(lens_ptr + b), 0), max_blocks * BS)
    n_valid = tl.minimum(tl.cdiv(ctx, BLOCK_N), NUM_SPLITS)  # splits the partial kernel wrote
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < n_valid
    row = (b * tl.num_programs(1) + h) * NUM_SPLITS + offs_s
    lse = tl.load(plse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty lane: all weights become 0
    w = tl.exp2(lse - m)
    o = tl.load(
        po_ptr + row[:, None] * D + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    denom = tl.sum(w, axis=0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + b * s_ob + h * s_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D
    )


def _block_n(d: int, bs: int) -> int:
    if interpreting():
        return 16
    # H200 sweep (benchmarks/kernels.py --sweep, head_dim 64): 128-token tiles with 2 stages
    # reach 84 % of copy bandwidth at 64 x 4k, against 62 % for 64-token tiles with 3.
    return 32 if d >= 256 else (64 if d > 64 else 128)


def plan_splits(batch: int, hkv: int, max_ctx: int, block_n: int, device: torch.device) -> int:
    """Number of KV splits from shapes only: enough programs to fill the GPU a few times over,
    but no more than a full-width context can give MIN_SPLIT_TOKENS each."""
    min_tokens = block_n if interpreting() else MIN_SPLIT_TOKENS
    want = triton.cdiv(4 * sm_count(device), max(batch * hkv, 1))
    return max(1, min(want, triton.cdiv(max_ctx, min_tokens), MAX_SPLITS))


def paged_decode_attention_impl(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """The keyword arguments override the shape-derived plan (tests and the tuning sweep)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "KV cache needs a unit last stride"
    assert hq % hkv == 0, f"q heads {hq} not a multiple of kv heads {hkv}"
    qg = hq // hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    max_blocks = block_tables.shape[1]
    block_n = block_n or _block_n(d, bs)
    max_ctx = max(max_blocks * bs, 1)
    if num_splits is None:
        num_splits = plan_splits(batch, hkv, max_ctx, block_n, q.device)
    if num_splits > 1:
        po = torch.empty(batch, hq, num_splits, d, dtype=torch.float32, device=q.device)
        plse = torch.empty(batch, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        po = plse = out  # unused
    _decode_partial_kernel[(batch, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        po,
        plse,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        max_blocks,
        QG=qg,
        BLOCK_G=max(16, pow2(qg)),
        D=d,
        BLOCK_D=pow2(d),
        BS=bs,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        **dot_flags(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages or (2 if d >= 256 or d <= 64 else 3),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, hq)](
            po,
            plse,
            context_lens,
            out,
            out.stride(0),
            out.stride(1),
            max_blocks,
            D=d,
            BLOCK_D=pow2(d),
            BS=bs,
            BLOCK_N=block_n,
            NUM_SPLITS=num_splits,
            BLOCK_S=pow2(num_splits),
            num_warps=4 if num_splits * d <= 8192 else 8,
        )
    return out


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, context_lens, scale: float
) -> torch.Tensor:
    return paged_decode_attention_impl(q, k_cache, v_cache, block_tables, context_lens, scale)
