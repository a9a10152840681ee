"""Prefix reuse over the block allocator: full blocks keyed by their chained 128-bit key.

    allocator free list (oldest freed first = evicted first)
      [ 7 | 3 | 12 | 5 | ... ]      7 and 12 still carry keys: evictable cache entries
        ^ allocate() pops here -> the popped block's key is dropped (evicted)

    a block is in one of three states:
      private   refcount >= 1, no key   (a request is computing it, or a duplicate)
      cached    refcount >= 1, key      (shared: incref per extra user)
      evictable refcount == 0, key      (on the free list; a hit take()s it back)

What a hit guarantees: block i is handed out only if its key, its own token ids (compared
exactly) and its parent's key all match the prompt's. So the block always holds the prompt's
tokens; that its KV was computed after the prompt's *earlier* tokens rests on the chain key
alone (request/block_hash.py): a wrong block needs two different prefixes with the same
128-bit blake2b key, i.e. a second preimage of a known prefix (about 2**128 work) or, for two
prompts both chosen by an attacker, a birthday collision (about 2**64 work). A full prompt is
never reused whole: the last token is always computed, since its logits give the first token.
Every allocation of the owning worker goes through `acquire` so that evictions are seen; frees
go straight to the allocator (refcounts make shared blocks safe to free once per owner).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from splitserve.request.block_allocator import BlockAllocator
from splitserve.request.block_hash import ROOT_KEY


class _Entry(NamedTuple):  # a tuple: a prompt's blocks are published by the hundred per step
    key: bytes
    parent_key: bytes
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool = True) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enabled
        self._by_key: dict[bytes, int] = {}  # key -> block id
        self._entries: dict[int, _Entry] = {}  # block id -> what it holds
        self._recent: OrderedDict[bytes, None] = OrderedDict()  # keys, most recently used last

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_key)

    def match(self, token_ids: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least the last token to compute;
        `keys` are the prompt's block keys (block_hash.block_keys)."""
        if not self.enabled:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_KEY
        for i, key in enumerate(keys[: (len(token_ids) - 1) // bs]):
            block = self._by_key.get(key)
            if block is None:
                break
            entry = self._entries[block]
            if entry.parent_key != parent or entry.tokens != tuple(
                token_ids[i * bs : (i + 1) * bs]
            ):
                break  # a key collision: treat as a miss
            hits.append(block)
            parent = key
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
            self._recent.move_to_end(self._entries[b].key)
        fresh = self.allocator.allocate(num_new)
        assert fresh is not None  # checked above
        for b in fresh.block_ids:
            self._evict(b)
        return [*hits, *fresh.block_ids]

    def register(self, block_id: int, key: bytes, parent_key: bytes, tokens: Sequence[int]) -> bool:
        """Publishes a fully computed block; False when the prefix is already cached elsewhere."""
        if not self.enabled or key in self._by_key or block_id in self._entries:
            return False
        self._by_key[key] = block_id
        self._entries[block_id] = _Entry(key, parent_key, tuple(tokens))
        self._recent[key] = None
        return True

    def register_run(
        self, block_ids: Sequence[int], keys: Sequence[bytes], start: int, stop: int, tokens
    ) -> None:
        """`register` for blocks start..stop-1 of one prompt: block i holds
        tokens[i * block_size : (i + 1) * block_size] under keys[i], after keys[i - 1]."""
        if not self.enabled:
            return
        bs = self.block_size
        for i in range(start, stop):
            parent = keys[i - 1] if i else ROOT_KEY
            self.register(block_ids[i], keys[i], parent, tokens[i * bs : (i + 1) * bs])

    def free(self, block_table: Sequence[int]) -> None:
        """Drops one owner's references, tail first, so that a prompt's tail blocks (the least
        shared) are evicted before its head."""
        self.allocator.free(reversed(block_table))

    def recent_keys(self, limit: int) -> list[bytes]:
        """Up to `limit` cached block keys, most recently used first."""
        out: list[bytes] = []
        for key in reversed(self._recent):
            if len(out) >= limit:
                break
            out.append(key)
        return out

    def _evict(self, block_id: int) -> None:
        entry = self._entries.pop(block_id, None)
        if entry is not None:
            del self._by_key[entry.key]
            del self._recent[entry.key]
