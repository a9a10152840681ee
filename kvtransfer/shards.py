"""Which listener holds which KV heads of a handle: the pull plan across tensor-parallel sizes.

    prefill TP2 (shards: rank 0 heads [0,h), rank 1 heads [h,2h))      decode pulls every shard:
        pull rank 1 ──▶ heads [h,2h)        (keeps the lease)            TP1: both into its pool
        pull rank 0 ──▶ heads [0,h)         (delivery releases the lease) TP2: rank 0 keeps its
    prefill TP1 (no shards): one source, heads [0,H), at KvHandle.address      heads, sends the rest
                                                                              to its followers
Rank 0's listener releases the lease when its shard is delivered, so it is pulled last: by then
every other rank's shard has left (a follower's blocks stay valid until rank 0 frees them).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.protos import kv_pb2


@dataclass(frozen=True)
class ShardSource:
    host: str
    port: int
    head_start: int
    head_end: int
    tp_rank: int = 0

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


def shard_sources(handle: kv_pb2.KvHandle) -> list[ShardSource]:
    """The listeners to pull from, rank 0 last; ValueError (names the field) when the shard map
    does not cover the heads [0, num_kv_heads) exactly once or lacks an address."""
    if not handle.shards:
        return [ShardSource(handle.address.host, handle.address.port, 0, handle.num_kv_heads)]
    shards = sorted(handle.shards, key=lambda s: s.kv_head_start)
    edge = 0
    for s in shards:
        if s.kv_head_start != edge or s.kv_head_end <= s.kv_head_start:
            raise ValueError(
                f"kv.shards do not cover the KV heads 0..{handle.num_kv_heads} once each (shard of "
                f"rank {s.tp_rank}: [{s.kv_head_start}, {s.kv_head_end})); pass the handle unchanged"
            )
        if not s.address.host or not 1 <= s.address.port <= 65535:
            raise ValueError(
                f"kv.shards[rank {s.tp_rank}].address needs a host and a port in 1..65535; "
                "pass the handle unchanged"
            )
        edge = s.kv_head_end
    if edge != handle.num_kv_heads:
        raise ValueError(
            f"kv.shards end at KV head {edge}, the model has {handle.num_kv_heads}; "
            "pass the handle unchanged"
        )
    out = [
        ShardSource(s.address.host, s.address.port, s.kv_head_start, s.kv_head_end, s.tp_rank)
        for s in shards
    ]
    return sorted(out, key=lambda s: s.tp_rank == 0)  # stable: rank 0 last


def head_overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None
