"""The prefill worker's parts on their own: prefix cache, lease table, scheduler, config."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.config.engine_config import SchedulerConfig
from splitserve.config.files import ConfigError
from splitserve.prefill_worker.config import PrefillWorkerConfig
from splitserve.prefill_worker.leases import LeaseTable
from splitserve.prefill_worker.prefix_cache import PrefixCache
from splitserve.prefill_worker.request import PrefillSeq
from splitserve.prefill_worker.scheduler import PrefillScheduler
from splitserve.request.block_allocator import BlockAllocator
from splitserve.request.block_hash import ROOT_HASH, block_hashes, chain_hash
from splitserve.request.errors import RequestError
from splitserve.request.sampling_params import SamplingParams

GOLDEN = 0x52263D4E44FF75FF  # chain_hash(ROOT_HASH, [0, 1, 2, 3])


def _publish(cache: PrefixCache, table, tokens) -> None:
    hashes = block_hashes(tokens, cache.block_size)
    bs = cache.block_size
    for i, h in enumerate(hashes):
        cache.register(
            table[i], h, hashes[i - 1] if i else ROOT_HASH, tokens[i * bs : (i + 1) * bs]
        )


def test_block_hashes_chain_and_are_stable():
    toks = list(range(10))
    hs = block_hashes(toks, 4)
    assert len(hs) == 2 and hs[1] == chain_hash(hs[0], toks[4:8])
    assert block_hashes([9, 1, 2, 3] + toks[4:8], 4)[1] != hs[1]  # the parent is part of the key
    # pinned: routers and workers of any version must agree on it
    assert hs[0] == chain_hash(ROOT_HASH, [0, 1, 2, 3]) == GOLDEN


def test_prefix_cache_reuse_eviction_and_collisions():
    alloc = BlockAllocator(8)  # 7 usable
    cache = PrefixCache(alloc, 4)
    prompt = list(range(1, 13))  # 3 full blocks
    table = cache.acquire([], 3)
    _publish(cache, table, prompt)
    assert cache.match(prompt, block_hashes(prompt, 4)) == table[:2]  # never the whole prompt
    assert cache.match(prompt + [99], block_hashes(prompt + [99], 4)) == table
    cache.free(table)  # evictable now, still matchable
    assert alloc.num_free == 7 and cache.num_cached_blocks == 3
    hits = cache.match(prompt + [99], block_hashes(prompt + [99], 4))
    got = cache.acquire(hits, 1)
    assert got[:3] == table and all(alloc.refcount(b) == 1 for b in got)
    cache.free(got)
    # a forged entry whose tokens differ under the same hash is a miss, not a wrong block
    other = [50, 51, 52, 53, 1]
    cache._by_hash[block_hashes(other, 4)[0]] = table[0]
    assert cache.match(other, block_hashes(other, 4)) == []
    del cache._by_hash[block_hashes(other, 4)[0]]
    # allocating every block evicts the cached ones (their hashes go)
    everything = cache.acquire([], 7)
    assert cache.num_cached_blocks == 0 and cache.recent_hashes(10) == []
    assert cache.acquire([], 1) is None
    cache.free(everything)
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_usable


def test_prefix_cache_hashes_most_recent_first_and_disabled_mode():
    alloc = BlockAllocator(16)
    cache = PrefixCache(alloc, 2)
    a, b = [1, 2, 3, 4, 5], [7, 8, 9]
    ta, tb = cache.acquire([], 3), cache.acquire([], 2)
    _publish(cache, ta, a)
    _publish(cache, tb, b)
    ha, hb = block_hashes(a, 2), block_hashes(b, 2)
    assert cache.recent_hashes(10) == [hb[0], ha[1], ha[0]]
    cache.free(cache.acquire(cache.match(a, ha), 1))  # a hit refreshes a's first block
    assert cache.recent_hashes(10) == [ha[1], ha[0], hb[0]]
    cache.free(ta)
    cache.free(tb)
    off = PrefixCache(BlockAllocator(4), 2, enabled=False)
    t = off.acquire([], 1)
    assert not off.register(t[0], 1, ROOT_HASH, [1, 2]) and off.match([1, 2, 3], [1]) == []


def test_lease_table_expiry_order_and_single_pop():
    now = [100.0]
    table = LeaseTable(clock=lambda: now[0])
    a = table.grant("ra", (1, 2), 8, ttl_s=1.0)
    b = table.grant("rb", (3,), 3, ttl_s=5.0)
    assert table.seconds_to_next_expiry() == pytest.approx(1.0)
    assert table.pop(a.lease_id) is a and table.pop(a.lease_id) is None
    assert table.seconds_to_next_expiry() == pytest.approx(5.0)  # the released one is skipped
    now[0] = 106.0
    assert table.pop_expired() == [b] and table.pop_expired() == [] and len(table) == 0
    c = table.grant("rc", (4,), 1, ttl_s=1.0)
    assert table.pop_request("rc") == [c] and table.seconds_to_next_expiry() is None


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _seq(loop, rid, n):
    prompt = list(range(1, n + 1))
    return PrefillSeq(
        rid, prompt, SamplingParams(), 30.0, block_hashes(prompt, 4), loop.create_future()
    )


def test_scheduler_chunks_under_budget_fifo_and_blocks_when_full(loop):
    alloc = BlockAllocator(9)  # 8 usable blocks of 4 tokens
    sched = PrefillScheduler(
        PrefixCache(alloc, 4), SchedulerConfig(max_num_batched_tokens=10, max_queue_len=3)
    )
    a, b, c = _seq(loop, "a", 13), _seq(loop, "b", 6), _seq(loop, "c", 4)
    for s in (a, b, c):
        sched.add(s)
    with pytest.raises(RequestError, match="queue is full"):
        sched.add(_seq(loop, "d", 1))
    with pytest.raises(RequestError, match="needs 9 KV blocks"):
        PrefillScheduler(PrefixCache(BlockAllocator(9), 4), SchedulerConfig()).add(
            _seq(loop, "big", 33)
        )
    step = [(x.seq.request_id, x.start, x.end) for x in sched.schedule()]
    assert step == [("a", 0, 10)]  # a takes the whole budget; all its 4 blocks are already held
    a.num_computed = 10
    step = [(x.seq.request_id, x.start, x.end) for x in sched.schedule()]
    assert step == [("a", 10, 13), ("b", 0, 6), ("c", 0, 1)]
    assert alloc.num_free == 8 - (4 + 2 + 1)
    a.num_computed, b.num_computed, c.num_computed = 13, 6, 1
    sched.remove(a)  # done: its blocks would go to a lease
    sched.remove(b)
    e, f = _seq(loop, "e", 5), _seq(loop, "f", 2)
    sched.add(e)
    sched.add(f)
    # e needs 2 blocks, 1 is free: e waits and f, which would fit, does not overtake it
    assert [(x.seq.request_id, x.start, x.end) for x in sched.schedule()] == [("c", 1, 4)]
    c.num_computed = 4
    sched.remove(c)
    for s in (a, b, c):
        sched.cache.free(s.block_table)
    assert [x.seq.request_id for x in sched.schedule()] == ["e", "f"]
    for s in (e, f):
        sched.remove(s)
        sched.cache.free(s.block_table)
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_usable


def test_config_from_yaml_and_flags(tmp_path):
    path = tmp_path / "prefill.yaml"
    path.write_text(
        "engine:\n  model_path: /m\n  cache: {block_size: 8}\nserver: {port: 5000}\nlease_ttl_s: 5\n"
    )
    cfg = PrefillWorkerConfig.load(
        path, {"server.port": 6000, "engine.cache.num_blocks": 100, "server.host": None}
    )
    assert (
        cfg.server.port,
        cfg.engine.cache.block_size,
        cfg.engine.cache.num_blocks,
        cfg.lease_ttl_s,
    ) == (6000, 8, 100, 5.0)
    with pytest.raises(ConfigError) as err:
        PrefillWorkerConfig.load(path, {"engine.cache.block_size": 3})
    assert "\n" not in str(err.value)
    assert "engine.cache: block_size must be a power of two, got 3" in str(err.value)
    with pytest.raises(ConfigError, match="lease_tll_s"):
        PrefillWorkerConfig.load(path, {"lease_tll_s": 3})
    with pytest.raises(ConfigError, match="engine: required"):
        PrefillWorkerConfig.load(None, {"lease_ttl_s": 3})
    with pytest.raises(ConfigError, match="must not exceed max_lease_ttl_s"):
        PrefillWorkerConfig.load(path, {"lease_ttl_s": 1000})
