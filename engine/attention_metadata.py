"""The typed attention metadata every layer reads (no globals): built once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each sequence attends to.

    slot_mapping  [T] int64   cache slot (block * block_size + offset) of each new token
    block_tables  [B, MB] int32  block ids per sequence, tail padded with the null block 0
    context_lens  [B] int32   tokens in the cache per sequence after this step (prefix + new)
    cu_seqlens_q  [B+1] int32 prefill only: packed query offsets
    max_query_len            prefill only: longest new chunk (a launch hint)
    dense_causal             prefill only: one sequence with nothing cached before this step
                             (rows = positions 0..T-1): its attention may run dense
                             (kernels/dense_attention.py, through engine/prefill_graphs.py)
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    is_prefill: bool
    cu_seqlens_q: torch.Tensor | None = None
    max_query_len: int = 1
    dense_causal: bool = False
