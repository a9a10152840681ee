"""Prefix reuse over the block allocator: full blocks keyed by their chained hash.

    allocator free list (oldest freed first = evicted first)
      [ 7 | 3 | 12 | 5 | ... ]      7 and 12 still carry hashes: evictable cache entries
        ^ allocate() pops here -> the popped block's hash is dropped (evicted)

    a block is in one of three states:
      private   refcount >= 1, no hash   (a request is computing it, or a duplicate)
      cached    refcount >= 1, hash      (shared: incref per extra user)
      evictable refcount == 0, hash      (on the free list; a hit take()s it back)

A hit is checked on token ids and parent hash, not on the hash alone, so a 64-bit
collision can never hand out a wrong block. A full prompt is never reused whole: the last
token is always computed, since its logits give the first token. Every allocation of the
owning worker goes through `acquire` so that evictions are seen; frees go straight to
the allocator (refcounts make shared blocks safe to free once per owner).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.request.block_allocator import BlockAllocator
from splitserve.request.block_hash import ROOT_HASH


@dataclass(frozen=True, slots=True)
class _Entry:
    block_hash: int
    parent_hash: int
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool = True) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enabled
        self._by_hash: dict[int, int] = {}  # hash -> block id
        self._entries: dict[int, _Entry] = {}  # block id -> what it holds
        self._recent: OrderedDict[int, None] = OrderedDict()  # hashes, most recently used last

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def match(self, token_ids: Sequence[int], hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least the last token to compute."""
        if not self.enabled:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_HASH
        for i, h in enumerate(hashes[: (len(token_ids) - 1) // bs]):
            block = self._by_hash.get(h)
            if block is None:
                break
            entry = self._entries[block]
            if entry.parent_hash != parent or entry.tokens != tuple(
                token_ids[i * bs : (i + 1) * bs]
            ):
                break  # a hash collision: treat as a miss
            hits.append(block)
            parent = h
        return hits

    def acquire(self, hits: Sequence[int], num_new: int) -> list[int] | None:
        """Takes a reference on every hit block plus `num_new` fresh blocks; all or nothing.
        Returns the block table (hits first) or None when the pool is short."""
        revived = sum(1 for b in hits if self.allocator.refcount(b) == 0)
        if not self.allocator.can_allocate(num_new + revived):
            return None
        for b in hits:
            if self.allocator.refcount(b) == 0:
                self.allocator.take(b)
            else:
                self.allocator.incref([b])
            self._recent.move_to_end(self._entries[b].block_hash)
        fresh = self.allocator.allocate(num_new)
        assert fresh is not None  # checked above
        for b in fresh.block_ids:
            self._evict(b)
        return [*hits, *fresh.block_ids]

    def register(
        self, block_id: int, block_hash: int, parent_hash: int, tokens: Sequence[int]
    ) -> bool:
        """Publishes a fully computed block; False when the prefix is already cached elsewhere."""
        if not self.enabled or block_hash in self._by_hash or block_id in self._entries:
            return False
        self._by_hash[block_hash] = block_id
        self._entries[block_id] = _Entry(block_hash, parent_hash, tuple(tokens))
        self._recent[block_hash] = None
        return True

    def free(self, block_table: Sequence[int]) -> None:
        """Drops one owner's references, tail first, so that a prompt's tail blocks (the least
        shared) are evicted before its head."""
        self.allocator.free(reversed(block_table))

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to `limit` cached block hashes, most recently used first."""
        out: list[int] = []
        for h in reversed(self._recent):
            if len(out) >= limit:
                break
            out.append(h)
        return out

    def _evict(self, block_id: int) -> None:
        entry = self._entries.pop(block_id, None)
        if entry is not None:
            del self._by_hash[entry.block_hash]
            del self._recent[entry.block_hash]
