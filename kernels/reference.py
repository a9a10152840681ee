"""Torch reference implementations of every hot-path op.

These are the CPU path and the oracle the Triton kernels are tested against. Shapes:

    T   packed tokens of a step          B   sequences in the batch
    Hq  query heads, Hkv key/value heads D   head dim
    kv_cache  [L, 2, NB, BS, Hkv, D]     one tensor for the pool; k_cache = kv_cache[l, 0]
    block_tables [B, MB] int32 (unused tail entries = 0, the null block)
    slot_mapping [T] int64: block_id * BS + offset (null-block slots write harmlessly)
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is kept in x's dtype like HF."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # NeoX / HF Llama style: the two halves of the rotary dims form the pairs.
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if rotated.shape[-1] == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half :]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T,Hq,D], k [T,Hkv,D], positions [T]; cos_sin_cache [max_pos, R] fp32 = cat(cos, sin), R <= D."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T,Hkv,D] into k_cache/v_cache [NB,BS,Hkv,D] at slot_mapping [T]."""
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(
        0, slot_mapping.long(), k.to(k_cache.dtype)
    )
    v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(
        0, slot_mapping.long(), v.to(v_cache.dtype)
    )


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotates q and k, writes rotated k and v into the cache, returns rotated q."""
    q_rot, k_rot = apply_rope(q, k, positions, cos_sin_cache)
    write_kv_cache(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    bs = cache.shape[1]
    n_blocks = (length + bs - 1) // bs
    blocks = cache[block_table[:n_blocks].long()]  # [n, BS, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int
) -> torch.Tensor:
    """q [Tq,Hq,D] at absolute positions q_start.., k/v [Tk,Hkv,D]; causal; fp32 math."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(hq // hkv, dim=1)
    v = v.float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(q.shape[0], device=q.device)[:, None] + q_start
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    scores.masked_fill_(k_pos > q_pos, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B,Hq,D] (one new token per sequence, already in the cache) -> [B,Hq,D]."""
    out = torch.empty_like(q)
    for b, length in enumerate(context_lens.tolist()):
        if length <= 0:  # padded lane
            out[b] = 0
            continue
        k = _gather_context(k_cache, block_tables[b], length)
        v = _gather_context(v_cache, block_tables[b], length)
        out[b] = _attend(q[b : b + 1], k, v, scale, q_start=length - 1)[0]
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens q [T,Hq,D] over the paged cache.

    Sequence b owns q rows cu_seqlens_q[b]:cu_seqlens_q[b+1]; its context_lens[b] counts every
    token in the cache after this step (cached prefix + new), so its first new token sits at
    position context_lens[b] - q_len_b. max_query_len is a launch hint for kernels. `out`
    (like q) receives the result when given (rows of no sequence are left as they are).
    """
    del max_query_len
    out = torch.empty_like(q) if out is None else out
    starts = cu_seqlens_q.tolist()
    for b, length in enumerate(context_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        k = _gather_context(k_cache, block_tables[b], length)
        v = _gather_context(v_cache, block_tables[b], length)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale, q_start=length - (hi - lo))
    return out


def pack_kv_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gathers blocks of every layer, K and V: [L,2,NB,BS,Hkv,D] -> [L,2,n,BS,Hkv,D] contiguous."""
    packed = kv_cache.index_select(2, block_ids.long())
    if out is None:
        return packed
    out.copy_(packed)
    return out


def unpack_kv_blocks(packed: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Scatters [L,2,n,BS,Hkv,D] back into kv_cache at block_ids."""
    kv_cache.index_copy_(2, block_ids.long(), packed.to(kv_cache.dtype))


def fused_add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T + bias, x + residual); residual None: no add (x is
    returned as the new residual). x [M,K], weight [N,K] -> out [M,N]."""
    if residual is None:
        normed, summed = rms_norm(x, norm_weight, eps), x
    else:
        normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return torch.nn.functional.linear(normed, weight, bias), summed


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu_and_mul(gate_up) @ weight.T + bias: gate_up [M,2I], weight [N,I] -> [M,N]."""
    return torch.nn.functional.linear(silu_and_mul(gate_up), weight, bias)


def linear_small_m(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T + bias (the plain GEMV the kernels offer for few tokens)."""
    return torch.nn.functional.linear(x, weight, bias)
