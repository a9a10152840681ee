"""The typed hand-off: building a `KvHandle` on the prefill side and checking it (or a pull
request) against the local pool before any byte moves."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from splitserve.protos import kv_pb2

DTYPE_TO_PROTO = {
    torch.float32: kv_pb2.KV_DTYPE_FP32,
    torch.float16: kv_pb2.KV_DTYPE_FP16,
    torch.bfloat16: kv_pb2.KV_DTYPE_BF16,
}
LAYOUT = kv_pb2.KV_LAYOUT_LAYER_KV_BLOCK_TOKEN_HEAD_DIM


class KvIncompatibleError(ValueError):
    """The two pools disagree on what a block means (maps to FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class PoolSpec:
    """What a KV block means in one pool; both sides must agree field for field."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    model_compat_hash: str

    @classmethod
    def of(
        cls, kv_cache: torch.Tensor, compat_hash: str, num_kv_heads: int | None = None
    ) -> PoolSpec:
        """`num_kv_heads`: the model's KV heads, when the pool of a tensor-parallel rank holds
        only a slice of them (the spec always describes the whole model)."""
        layers, two, _blocks, block_size, heads, head_dim = kv_cache.shape
        assert two == 2, "kv_cache must be [L, 2, NB, BS, Hkv, D]"
        return cls(layers, num_kv_heads or heads, head_dim, block_size, kv_cache.dtype, compat_hash)

    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def fields(self) -> dict:
        return dict(
            layout=LAYOUT,
            dtype=DTYPE_TO_PROTO[self.dtype],
            block_size=self.block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            model_compat_hash=self.model_compat_hash,
        )


def make_handle(
    spec: PoolSpec,
    *,
    host: str,
    port: int,
    lease_id: str,
    request_id: str,
    num_blocks: int,
    num_tokens: int,
    ttl_s: float,
    shard_ports: list[int] | None = None,
) -> kv_pb2.KvHandle:
    """`shard_ports`: the UCX port of each tensor-parallel rank (rank r holds the r-th equal
    slice of the KV heads); None or one port: no shard map (tp_size 1)."""
    handle = kv_pb2.KvHandle(
        address=kv_pb2.UcxAddress(host=host, port=port),
        lease_id=lease_id,
        request_id=request_id,
        num_blocks=num_blocks,
        num_tokens=num_tokens,
        ttl_ms=int(ttl_s * 1000),
        expires_at_unix_ms=int((time.time() + ttl_s) * 1000),
        **spec.fields(),
    )
    handle.shards.extend(shard_map(spec.num_kv_heads, host, shard_ports))
    return handle


def shard_map(num_kv_heads: int, host: str, shard_ports: list[int] | None) -> list[kv_pb2.KvShard]:
    """Rank r of len(shard_ports) holds the r-th equal slice of the KV heads at port r; empty
    for None or one port (tp_size 1). KvHandle.shards and WorkerLoad.kv_shards."""
    if not shard_ports or len(shard_ports) < 2:
        return []
    size, part = len(shard_ports), num_kv_heads // len(shard_ports)
    return [
        kv_pb2.KvShard(
            tp_rank=r,
            tp_size=size,
            kv_head_start=r * part,
            kv_head_end=(r + 1) * part,
            address=kv_pb2.UcxAddress(host=host, port=p),
        )
        for r, p in enumerate(shard_ports)
    ]


def _shown(value) -> str:
    """A peer's value for a message: its repr, cut short (a status's details are capped)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def check_compatible(remote, local: PoolSpec) -> None:
    """`remote` is a KvHandle or KvPullRequest; raises KvIncompatibleError naming each mismatch."""
    mismatches = [
        f"{name}: remote {_shown(getattr(remote, name))} != local {want!r}"
        for name, want in local.fields().items()
        if getattr(remote, name) != want
    ]
    if mismatches:
        raise KvIncompatibleError(
            "KV pools are incompatible ("
            + "; ".join(mismatches)
            + "); pair workers that serve the same "
            "model with the same dtype and block size"
        )
