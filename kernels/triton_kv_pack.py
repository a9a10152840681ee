"""Gather / scatter of whole KV blocks across all layers for the prefill -> decode hand-off.

kv_cache [L, 2, NB, BS, Hkv, D]: one (layer, K/V, block) is a contiguous run of
E = BS*Hkv*D elements, so each program copies one CHUNK of one such run with wide,
coalesced loads and stores. Grid (n_blocks * chunks, L * 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import pow2


@triton.jit
def _kv_blocks_copy_kernel(
    cache_ptr,
    packed_ptr,
    ids_ptr,
    c_l,
    c_kv,
    c_nb,
    p_l,
    p_kv,
    p_nb,
    E,
    CHUNKS,
    BLOCK: tl.constexpr,
    PACK: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid // CHUNKS
    chunk = pid % CHUNKS
    lk = tl.program_id(1).to(tl.int64)
    layer, kv = lk // 2, lk % 2
    blk = tl.load(ids_ptr + i).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    cache_off = layer * c_l + kv * c_kv + blk * c_nb
    packed_off = layer * p_l + kv * p_kv + i.to(tl.int64) * p_nb
    if PACK:
        x = tl.load(cache_ptr + cache_off + offs, mask=mask)
        tl.store(packed_ptr + packed_off + offs, x, mask=mask)
    else:
        x = tl.load(packed_ptr + packed_off + offs, mask=mask)
        tl.store(cache_ptr + cache_off + offs, x, mask=mask)


def _blocks_contiguous(t: torch.Tensor) -> bool:
    _, _, _, bs, hkv, d = t.shape
    return t.stride(5) == 1 and t.stride(4) == d and t.stride(3) == hkv * d


def _launch(
    kv_cache: torch.Tensor, packed: torch.Tensor, block_ids: torch.Tensor, pack: bool
) -> None:
    assert kv_cache.dim() == 6 and _blocks_contiguous(kv_cache), (
        "kv_cache must be [L,2,NB,BS,Hkv,D], blocks contiguous"
    )
    n = block_ids.numel()
    num_layers = kv_cache.shape[0]
    elems = kv_cache.shape[3] * kv_cache.shape[4] * kv_cache.shape[5]
    if n == 0 or num_layers == 0 or elems == 0:
        return
    block = min(pow2(elems), 8192)
    chunks = triton.cdiv(elems, block)
    _kv_blocks_copy_kernel[(n * chunks, num_layers * 2)](
        kv_cache,
        packed,
        block_ids,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        packed.stride(0),
        packed.stride(1),
        packed.stride(2),
        elems,
        chunks,
        BLOCK=block,
        PACK=pack,
        num_warps=8 if block >= 4096 else 4,
    )


def pack_kv_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    shape = (*kv_cache.shape[:2], block_ids.numel(), *kv_cache.shape[3:])
    if out is not None:
        assert tuple(out.shape) == shape, f"out has shape {tuple(out.shape)}, expected {shape}"
    target = out if out is not None and _blocks_contiguous(out) else None
    if target is None:
        dtype = kv_cache.dtype if out is None else out.dtype
        target = torch.empty(shape, dtype=dtype, device=kv_cache.device)
    _launch(kv_cache, target, block_ids.reshape(-1), pack=True)
    if out is not None and target is not out:
        out.copy_(target)
        return out
    return target


def unpack_kv_blocks(packed: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    if not _blocks_contiguous(packed):
        packed = packed.contiguous()
    _launch(kv_cache, packed, block_ids.reshape(-1), pack=False)
