"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Projections are fused (one qkv matmul, one gate_up matmul) and every other op goes through
`splitserve.kernels.ops`, so the same forward runs the torch reference on CPU and the Triton
kernels on CUDA, eagerly or inside a captured CUDA graph (no host syncs in `forward`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention_metadata import AttentionMetadata
from splitserve.engine.config import ModelConfig
from splitserve.kernels import ops


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
        self.cfg = cfg
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.post_attention_norm = _param(h, dtype=dtype, device=device)
        self.qkv_weight = _param(qkv, h, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.o_weight = _param(h, cfg.q_size, dtype=dtype, device=device)
        self.o_bias = _param(h, dtype=dtype, device=device) if cfg.o_proj_bias else None
        self.gate_up_weight = _param(2 * cfg.intermediate_size, h, dtype=dtype, device=device)
        self.gate_up_bias = _param(2 * cfg.intermediate_size, dtype=dtype, device=device) if cfg.mlp_bias else None
        self.down_weight = _param(h, cfg.intermediate_size, dtype=dtype, device=device)
        self.down_bias = _param(h, dtype=dtype, device=device) if cfg.mlp_bias else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, hidden, residual, positions, cos_sin, k_cache, v_cache, meta: AttentionMetadata):
        cfg = self.cfg
        if residual is None:
            x, residual = ops.rms_norm(hidden, self.input_norm, cfg.rms_norm_eps), hidden
        else:
            x, residual = ops.fused_add_rms_norm(hidden, residual, self.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        t = qkv.shape[0]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(t, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(t, cfg.num_key_value_heads, cfg.head_dim)
        v = v.view(t, cfg.num_key_value_heads, cfg.head_dim)
        q = ops.rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            attn = ops.prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                meta.max_query_len, self.scale,
            )
        else:
            attn = ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale)
        hidden = F.linear(attn.reshape(t, cfg.q_size), self.o_weight, self.o_bias)
        x, residual = ops.fused_add_rms_norm(hidden, residual, self.post_attention_norm, cfg.rms_norm_eps)
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        hidden = F.linear(ops.silu_and_mul(gate_up), self.down_weight, self.down_bias)
        return hidden, residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_hidden_layers))
        self.final_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device
        )

    def forward(self, input_ids, positions, kv_cache: torch.Tensor, cos_sin, meta: AttentionMetadata):
        """input_ids/positions [T]; kv_cache [L,2,NB,BS,Hkv,D] -> final hidden states [T,H]."""
        hidden = F.embedding(input_ids, self.embed)
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, positions, cos_sin, kv_cache[i, 0], kv_cache[i, 1], meta)
        hidden, _ = ops.fused_add_rms_norm(hidden, residual, self.final_norm, self.cfg.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
