"""RoPE (NeoX / HF rotate-half), paged KV-cache writes, and the fused RoPE + KV write.

One program per token handles every head of that token, so the cos/sin row is loaded once
and the k/v rows go straight to their cache slot. Partial rotary (R = 2*HALF < D) copies the
tail dims unchanged. Rounding matches the reference: rotate in fp32, round to the input
dtype, then (for cache writes) convert to the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import pow2


@triton.jit
def _rotate_heads(
    src,
    s_h,
    dst,
    d_h,
    H,
    cos,
    sin,
    HALF: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    """Rotates rows src[h, :] (h < H, head stride s_h) into dst[h, :]; cos/sin [BLOCK_HALF] fp32."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < H) & (offs_r[None, :] < HALF)
    p1 = src + offs_h[:, None] * s_h + offs_r[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype)
    o2 = (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype)
    q1 = dst + offs_h[:, None] * d_h + offs_r[None, :]
    tl.store(q1, o1, mask=mask)
    tl.store(q1 + HALF, o2, mask=mask)
    if 2 * HALF < D:  # partial rotary: the tail passes through
        offs_t = 2 * HALF + tl.arange(0, BLOCK_TAIL)
        tmask = (offs_h[:, None] < H) & (offs_t[None, :] < D)
        tail = tl.load(src + offs_h[:, None] * s_h + offs_t[None, :], mask=tmask, other=0.0)
        tl.store(dst + offs_h[:, None] * d_h + offs_t[None, :], tail, mask=tmask)


@triton.jit
def _copy_heads(
    src, s_h, dst, d_h, H, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    x = tl.load(src + offs_h[:, None] * s_h + offs_d[None, :], mask=mask, other=0.0)
    tl.store(dst + offs_h[:, None] * d_h + offs_d[None, :], x, mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cs_ptr,
    qo_ptr,
    ko_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    sqo_t,
    sqo_h,
    sko_t,
    sko_h,
    s_cs,
    skc_b,
    skc_s,
    skc_h,
    svc_b,
    svc_s,
    svc_h,
    HQ,
    HKV,
    HALF: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cs_ptr + pos * s_cs + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + t * sq_t,
        sq_h,
        qo_ptr + t * sqo_t,
        sqo_h,
        HQ,
        cos,
        sin,
        HALF,
        D,
        BLOCK_HQ,
        BLOCK_HALF,
        BLOCK_TAIL,
    )
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if (
            slot >= 0
        ):  # a negative slot means "no cache write" (defensive; the engine pads with null-block slots)
            blk = slot // BS
            off = slot % BS
            _rotate_heads(
                k_ptr + t * sk_t,
                sk_h,
                kc_ptr + blk * skc_b + off * skc_s,
                skc_h,
                HKV,
                cos,
                sin,
                HALF,
                D,
                BLOCK_HKV,
                BLOCK_HALF,
                BLOCK_TAIL,
            )
            _copy_heads(
                v_ptr + t * sv_t,
                sv_h,
                vc_ptr + blk * svc_b + off * svc_s,
                svc_h,
                HKV,
                D,
                BLOCK_HKV,
                BLOCK_D,
            )
    else:
        _rotate_heads(
            k_ptr + t * sk_t,
            sk_h,
            ko_ptr + t * sko_t,
            sko_h,
            HKV,
            cos,
            sin,
            HALF,
            D,
            BLOCK_HKV,
            BLOCK_HALF,
            BLOCK_TAIL,
        )


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    skc_b,
    skc_s,
    skc_h,
    svc_b,
    svc_s,
    svc_h,
    HKV,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BS
        off = slot % BS
        _copy_heads(
            k_ptr + t * sk_t,
            sk_h,
            kc_ptr + blk * skc_b + off * skc_s,
            skc_h,
            HKV,
            D,
            BLOCK_HKV,
            BLOCK_D,
        )
        _copy_heads(
            v_ptr + t * sv_t,
            sv_h,
            vc_ptr + blk * svc_b + off * svc_s,
            svc_h,
            HKV,
            D,
            BLOCK_HKV,
            BLOCK_D,
        )


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _cache_strides(c: torch.Tensor) -> tuple[int, int, int]:
    assert c.dim() == 4 and c.stride(-1) == 1, (
        "cache must be [NB, BS, Hkv, D] with a unit last stride"
    )
    return c.stride(0), c.stride(1), c.stride(2)


def _rope(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """Shared launcher: with a cache, rotated k and v go to the cache (returns q_rot, None)."""
    q, k = _unit_last(q), _unit_last(k)
    num_t, hq, d = q.shape
    hkv = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    assert rot % 2 == 0 and rot <= d, f"cos_sin_cache width {rot} must be even and <= head_dim {d}"
    cs = _unit_last(cos_sin_cache)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    write = k_cache is not None
    k_out = None if write else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_t == 0:
        return q_out, k_out
    if write:
        v = _unit_last(v)
        kc, vc = _cache_strides(k_cache), _cache_strides(v_cache)
        bs = k_cache.shape[1]
        ko, sko, vv, sv = k_cache, (0, 0), v, (v.stride(0), v.stride(1))
    else:
        kc = vc = (0, 0, 0)
        bs = 1
        ko, sko, vv, sv = k_out, (k_out.stride(0), k_out.stride(1)), k, (0, 0)
        k_cache = v_cache = slot_mapping = k  # unused pointers
    half = rot // 2
    _rope_kernel[(num_t,)](
        q,
        k,
        vv,
        positions,
        cs,
        q_out,
        ko,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        *sv,
        q_out.stride(0),
        q_out.stride(1),
        *sko,
        cs.stride(0),
        *kc,
        *vc,
        hq,
        hkv,
        HALF=half,
        D=d,
        BS=bs,
        BLOCK_HQ=pow2(hq),
        BLOCK_HKV=pow2(hkv),
        BLOCK_HALF=pow2(half),
        BLOCK_TAIL=pow2(d - 2 * half),
        BLOCK_D=pow2(d),
        WRITE_CACHE=write,
        num_warps=4 if hq * d <= 4096 else 8,
    )
    return q_out, k_out


def apply_rope(q, k, positions, cos_sin_cache):
    return _rope(q, k, None, positions, cos_sin_cache, None, None, None)


def rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    q_out, _ = _rope(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return q_out


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    k, v = _unit_last(k), _unit_last(v)
    num_t, hkv, d = k.shape
    if num_t == 0:
        return
    kc, vc = _cache_strides(k_cache), _cache_strides(v_cache)
    _write_kv_kernel[(num_t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *kc,
        *vc,
        hkv,
        D=d,
        BS=k_cache.shape[1],
        BLOCK_HKV=pow2(hkv),
        BLOCK_D=pow2(d),
        num_warps=4,
    )
