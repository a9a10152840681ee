from __future__ import annotations

import random

import pytest

from splitserve.request.block_allocator import NULL_BLOCK, BlockAllocator, BlockAllocatorError


def test_null_block_never_handed_out_and_no_overlap():
    alloc = BlockAllocator(9)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert alloc.allocate(1) is None  # exhausted: nothing taken
    ids = a.block_ids + b.block_ids
    assert NULL_BLOCK not in ids and len(set(ids)) == 8
    alloc.check_integrity()
    alloc.free(a.block_ids)
    alloc.free(b.block_ids)
    assert alloc.num_free == alloc.num_usable == 8


def test_double_free_and_null_free_rejected():
    alloc = BlockAllocator(4)
    got = alloc.allocate(2)
    alloc.free(got.block_ids)
    with pytest.raises(BlockAllocatorError, match="double free"):
        alloc.free(got.block_ids[:1])
    with pytest.raises(BlockAllocatorError, match="invalid block"):
        alloc.free([NULL_BLOCK])
    alloc.check_integrity()


def test_refcount_shares_block_until_last_owner_frees():
    alloc = BlockAllocator(4)
    (blk,) = alloc.allocate(1).block_ids
    alloc.incref([blk])
    assert alloc.free([blk]) == [] and alloc.refcount(blk) == 1
    assert alloc.free([blk]) == [blk] and alloc.num_free == 3
    alloc.take(blk)  # a specific free block can be taken back (prefix-cache hit)
    assert alloc.refcount(blk) == 1 and alloc.num_free == 2
    with pytest.raises(BlockAllocatorError):
        alloc.take(blk)
    alloc.free([blk])


def test_random_churn_keeps_invariants():
    rng = random.Random(0)
    alloc = BlockAllocator(33)
    live: list[tuple[int, ...]] = []
    for _ in range(500):
        if live and rng.random() < 0.5:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            got = alloc.allocate(rng.randint(0, 5))
            if got is not None:
                live.append(got.block_ids)
        alloc.check_integrity()
        held = [b for ids in live for b in ids]
        assert len(held) == len(set(held)) and alloc.num_free == 32 - len(held)
    for ids in live:
        alloc.free(ids)
    assert alloc.num_free == alloc.num_usable
