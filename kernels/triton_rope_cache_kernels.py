"""Triton kernel bodies of triton_rope_cache.py (its launchers): RoPE, paged KV-cache writes.

    rope_kernel       one program per token: rotates its q heads into q_out, and its k heads
                      into k_out, or (WRITE_CACHE) into the token's cache slot with v copied
                      alongside; a negative slot writes nothing
    write_kv_kernel   one program per token: k and v rows copied to the token's cache slot

Rotation is NeoX / HF rotate-half in fp32, rounded to the input dtype; the store converts to
the destination's dtype. Partial rotary (2 * HALF < D) copies the tail dims unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def rope_kernel(
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
def write_kv_kernel(
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
