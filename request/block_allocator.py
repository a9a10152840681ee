"""Ref-counted allocator of paged KV blocks.

    block ids:  0 | 1 2 3 ... num_blocks-1
                ^ null block: never handed out, never freed; padded graph lanes and
                  unused block-table tails point here and may scribble on it.

    invariants (check_integrity):  every usable block is either on the free list with
    refcount 0, or off it with refcount >= 1; the free list is a set (no id twice by construction).

Callers see only `Allocation` (the ids) and counts; ref counts let the prefix cache share a
block between requests, and a block returns to the free list when its last owner frees it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

NULL_BLOCK = 0


class BlockAllocatorError(RuntimeError):
    """A double free, a free of a block never allocated, or a broken invariant."""


@dataclass(frozen=True)
class Allocation:
    block_ids: tuple[int, ...]


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        # Insertion order = reuse order (oldest freed first), so a prefix cache keeps its most
        # recently used blocks longest; OrderedDict gives O(1) removal of a specific block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> Allocation | None:
        """n fresh blocks with refcount 1, or None (nothing taken) when too few are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids = tuple(self._free.popitem(last=False)[0] for _ in range(n))
        for b in ids:
            self._refcount[b] = 1
        return Allocation(ids)

    def take(self, block_id: int) -> None:
        """Takes one specific free block (a prefix-cache hit on an evictable block)."""
        if self._refcount[block_id] != 0:
            raise BlockAllocatorError(f"block {block_id} is not free")
        del self._free[block_id]
        self._refcount[block_id] = 1

    def incref(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if self._refcount[b] <= 0:
                raise BlockAllocatorError(f"incref of free block {b}")
            self._refcount[b] += 1

    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Drops one reference from each block; returns the ids that became free."""
        released = []
        for b in block_ids:
            if b == NULL_BLOCK or not 0 < b < self.num_blocks:
                raise BlockAllocatorError(f"free of invalid block {b}")
            if self._refcount[b] <= 0:
                raise BlockAllocatorError(f"double free of block {b}")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free[b] = None
                released.append(b)
        return released

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def check_integrity(self) -> None:
        free = list(self._free)
        if NULL_BLOCK in free or self._refcount[NULL_BLOCK] != 0:
            raise BlockAllocatorError("the null block was handed out")
        on_list = set(free)
        for b in range(1, self.num_blocks):
            if (b in on_list) != (self._refcount[b] == 0) or self._refcount[b] < 0:
                raise BlockAllocatorError(
                    f"block {b}: refcount {self._refcount[b]}, on free list {b in on_list}"
                )
