"""Chained hashes of full KV blocks: the key of prefix reuse, shared by the workers (which
cache blocks) and the router (which routes a prompt to the worker holding its prefix).

    hash(block i) = blake2b-64(hash(block i-1) || token ids of block i)   (block -1: ROOT)

A block's hash therefore names its whole prefix. The function is stable across processes
and hosts (no Python `hash()`), and fits the `fixed64` of `PrefixCacheSummary`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(struct.pack("<Q", parent), digest_size=8)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of the full blocks of `token_ids` (a partial last block has none)."""
    out: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out
