"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Projections are fused (one qkv matmul, one gate_up matmul) and every other op goes through
`splitserve.kernels.ops`, so the same forward runs the torch reference on CPU and the Triton
kernels on CUDA, eagerly or inside a captured CUDA graph (no host syncs in `forward`).

Each norm is fused into the linear layer that follows it (add + norm + qkv, add + norm +
gate_up, final add + norm + lm_head) and the activation into the down projection: at few
tokens (decode, <= ops.SMALL_M_MAX) each pair is one Triton GEMV kernel; at more tokens the ops
compose the norm / activation kernel with a cuBLAS matmul, the same math as unfused.

Tensor parallel (parallel.py): qkv / gate_up column-parallel, o / down row-parallel (all_reduce);
embedding and lm_head vocab-parallel (masked lookup + all_reduce; logits slice + all_gather),
so no rank reads the whole lm_head per step. At TP 1 none of these collectives exist.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.config.engine_config import ModelConfig
from splitserve.engine.attention_metadata import AttentionMetadata
from splitserve.engine.parallel import SINGLE, TPGroup
from splitserve.kernels import ops

# Small-M choices the H200 benchmark decides (benchmarks/kernels.py, fused_linear cases):
GEMV_O_PROJ = True  # o_proj through the Triton GEMV (H200, M=1: 8.2 us vs cuBLAS 10.0 us)
GEMV_LM_HEAD = True  # final norm fused into a Triton GEMV lm_head instead of norm + cuBLAS


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.num_heads = cfg.num_attention_heads // tp.size  # this rank's share
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size // tp.size
        h, qkv = cfg.hidden_size, self.q_size + 2 * self.kv_size
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.post_attention_norm = _param(h, dtype=dtype, device=device)
        self.qkv_weight = _param(qkv, h, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.o_weight = _param(h, self.q_size, dtype=dtype, device=device)
        self.o_bias = _param(h, dtype=dtype, device=device) if cfg.o_proj_bias else None
        self.gate_up_weight = _param(2 * inter, h, dtype=dtype, device=device)
        self.gate_up_bias = _param(2 * inter, dtype=dtype, device=device) if cfg.mlp_bias else None
        self.down_weight = _param(h, inter, dtype=dtype, device=device)
        self.down_bias = _param(h, dtype=dtype, device=device) if cfg.mlp_bias else None
        self.scale = cfg.head_dim**-0.5

    def _row_parallel(self, out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The partial sums of a row-parallel linear (computed without bias) summed over ranks,
        then the bias once."""
        out = self.tp.all_reduce(out)
        return out if bias is None else out + bias

    def forward(
        self, hidden, residual, positions, cos_sin, k_cache, v_cache, meta: AttentionMetadata
    ):
        q, residual = self.pre_attention(
            hidden, residual, positions, cos_sin, k_cache, v_cache, meta.slot_mapping
        )
        return self.post_attention(self.attention(q, k_cache, v_cache, meta), residual)

    # The three parts of a layer: the piecewise prefill graphs (engine/prefill_graphs.py)
    # capture pre_attention and post_attention and run attention between them.
    def pre_attention(self, hidden, residual, positions, cos_sin, k_cache, v_cache, slot_mapping):
        """Residual add + norm, QKV projection, RoPE and the KV-cache write -> (q, residual)."""
        cfg = self.cfg
        qkv, residual = ops.fused_add_rms_norm_linear(
            hidden, residual, self.input_norm, cfg.rms_norm_eps, self.qkv_weight, self.qkv_bias
        )
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, cfg.head_dim)
        k = k.view(t, self.num_kv_heads, cfg.head_dim)
        v = v.view(t, self.num_kv_heads, cfg.head_dim)
        q = ops.rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
        return q, residual

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, out=None) -> torch.Tensor:
        """[T, Hq, D] queries over the paged cache (varlen prefill or decode) -> [T, Hq, D]
        (prefill: into `out` when given)."""
        if meta.is_prefill:
            return ops.prefill_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.cu_seqlens_q,
                meta.context_lens,
                meta.max_query_len,
                self.scale,
                out,
            )
        return ops.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale
        )

    def post_attention(self, attn, residual):
        """O projection, residual add + norm, MLP -> (hidden, residual)."""
        cfg, tp = self.cfg, self.tp.enabled
        hidden = ops.linear_small_m(
            attn.reshape(attn.shape[0], self.q_size),
            self.o_weight,
            None if tp else self.o_bias,
            gemv=GEMV_O_PROJ,
        )
        if tp:
            hidden = self._row_parallel(hidden, self.o_bias)
        gate_up, residual = ops.fused_add_rms_norm_linear(
            hidden,
            residual,
            self.post_attention_norm,
            cfg.rms_norm_eps,
            self.gate_up_weight,
            self.gate_up_bias,
        )
        hidden = ops.silu_mul_linear(gate_up, self.down_weight, None if tp else self.down_bias)
        if tp:
            hidden = self._row_parallel(hidden, self.down_bias)
        return hidden, residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        cfg.check_tensor_parallel(tp.size)
        self.cfg, self.tp = cfg, tp
        # vocab-parallel embedding / lm_head under TP: this rank's rows [vocab_start, vocab_start + rows)
        self.vocab_start, rows = (
            tp.vocab_shard(cfg.vocab_size) if tp.enabled else (0, cfg.vocab_size)
        )
        self.embed = _param(rows, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, device, tp) for _ in range(cfg.num_hidden_layers)
        )
        # called after layer i's KV write is issued (the prefill worker's streamed hand-over)
        self.on_layer_kv: Callable[[int], None] | None = None
        self.final_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            self.embed
            if cfg.tie_word_embeddings
            else _param(rows, cfg.hidden_size, dtype=dtype, device=device)
        )
        real = min(max(cfg.vocab_size - self.vocab_start, 0), rows)  # rows past the vocab: padding
        for p in {id(self.embed): self.embed, id(self.lm_head): self.lm_head}.values():
            p.data[real:].zero_()  # never loaded; zero so no garbage (NaN) ever enters a sum

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(input_ids, self.embed)
        # ids outside this rank's slice give zero rows; the sum over ranks is the full embedding
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))

    def _full_logits(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's logits [R, rows] (model dtype) -> fp32 logits [R, V] of the whole vocab."""
        if not self.tp.enabled:
            return local.float()
        r, rows = local.shape
        gathered = self.tp.all_gather_rows(local).view(
            self.tp.size, r, rows
        )  # rank-major, model dtype
        full = torch.empty(r, self.tp.size, rows, dtype=torch.float32, device=local.device)
        full.copy_(gathered.transpose(0, 1))  # -> row-major and fp32 in one copy
        full = full.view(r, self.tp.size * rows)
        vocab = self.cfg.vocab_size
        # padded columns are never sampled: sliced off (one small copy, only when V % tp != 0)
        return full if full.shape[1] == vocab else full[:, :vocab].contiguous()

    def _layers(self, input_ids, positions, kv_cache, cos_sin, meta):
        """-> (hidden, residual) after the last layer (num_hidden_layers >= 1: residual is set)."""
        hidden = self._embed(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(
                hidden, residual, positions, cos_sin, kv_cache[i, 0], kv_cache[i, 1], meta
            )
            if self.on_layer_kv is not None:  # layer i's KV is written (streamed hand-over)
                self.on_layer_kv(i)
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final (normed) hidden states [R,H] -> fp32 logits [R,V]."""
        return self._full_logits(F.linear(hidden, self.lm_head))

    def logits(
        self,
        input_ids,
        positions,
        kv_cache: torch.Tensor,
        cos_sin,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T]; kv_cache [L,2,NB,BS,Hkv,D] -> fp32 logits [R,V] of the token rows
        `rows` (all T when None): the final norm runs on those rows only, fused into the lm_head
        GEMV at few rows (decode)."""
        hidden, residual = self._layers(input_ids, positions, kv_cache, cos_sin, meta)
        return self.final_logits(hidden, residual, rows)

    def final_logits(self, hidden, residual, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's (hidden, residual) -> fp32 logits of `rows` (all when None)."""
        if rows is not None:
            hidden, residual = hidden[rows], residual[rows]
        eps = self.cfg.rms_norm_eps
        if GEMV_LM_HEAD:
            return self._full_logits(
                ops.fused_add_rms_norm_linear(hidden, residual, self.final_norm, eps, self.lm_head)[
                    0
                ]
            )
        return self.compute_logits(
            ops.fused_add_rms_norm(hidden, residual, self.final_norm, eps)[0]
        )
