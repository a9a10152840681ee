"""The paged KV pool: one tensor [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim].

One tensor (rather than a list per layer) lets the transfer path gather a request's blocks
from every layer with one pack kernel, and per-layer K/V views are still contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.config.engine_config import CacheConfig, ModelConfig


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def kv_geometry(
    model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, tp_size: int = 1
) -> KVGeometry:
    """The pool of one rank: under tensor parallelism it holds only its num_kv_heads / tp heads."""
    return KVGeometry(
        model.num_hidden_layers,
        model.num_key_value_heads // tp_size,
        model.head_dim,
        cache.block_size,
        dtype,
    )


def choose_num_blocks(
    geom: KVGeometry, cache: CacheConfig, device: torch.device, reserve_bytes: int
) -> int:
    """Explicit `num_blocks`, else a share of the device's free memory (CPU: `cpu_num_blocks`)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    if device.type != "cuda":
        return cache.cpu_num_blocks
    free, _total = torch.cuda.mem_get_info(device)
    budget = int(free * cache.memory_fraction) - reserve_bytes
    blocks = budget // geom.bytes_per_block
    if blocks < 2:
        raise MemoryError(
            f"only {free / 2**30:.1f} GiB free on {device}: no room for a KV pool; "
            "lower the model size or set cache.num_blocks"
        )
    return int(blocks)


def allocate_kv_pool(geom: KVGeometry, num_blocks: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(
        geom.num_layers,
        2,
        num_blocks,
        geom.block_size,
        geom.num_kv_heads,
        geom.head_dim,
        dtype=geom.dtype,
        device=device,
    )
