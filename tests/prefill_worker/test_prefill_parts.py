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
from splitserve.request.block_hash import KEY_BYTES, ROOT_KEY, block_keys, chain_key
from splitserve.request.errors import RequestError
from splitserve.request.sampling_params import SamplingParams

# chain_key(ROOT_KEY, [0, 1, 2, 3]): blake2b(16 zero bytes || uint32 LE 0 1 2 3, digest_size=16)
GOLDEN = bytes.fromhex("206edb31760756de8ad76f30a1676152")


def _publish(cache: PrefixCache, table, tokens) -> None:
    keys = block_keys(tokens, cache.block_size)
    bs = cache.block_size
    for i, key in enumerate(keys):
        cache.register(table[i], key, keys[i - 1] if i else ROOT_KEY, tokens[i * bs : (i + 1) * bs])


def test_block_keys_are_16_bytes_chain_and_are_stable():
    toks = list(range(10))
    ks = block_keys(toks, 4)
    assert len(ks) == 2 and ks[1] == chain_key(ks[0], toks[4:8])
    assert all(type(k) is bytes and len(k) == KEY_BYTES == 16 for k in ks)
    # pinned: routers and workers of any version must agree on it
    assert ks[0] == chain_key(ROOT_KEY, [0, 1, 2, 3]) == GOLDEN
    with pytest.raises(ValueError, match="16 bytes"):
        chain_key(ROOT_KEY[:8], [0, 1, 2, 3])  # a 64-bit parent is refused, never padded


def test_a_change_in_any_block_changes_that_key_and_every_later_one():
    prompt = list(range(1, 22))  # 5 full blocks of 4 and a partial one (no key)
    keys = block_keys(prompt, 4)
    assert len(keys) == 5 and len(set(keys)) == 5
    for pos in range(20):
        changed = list(prompt)
        changed[pos] += 1000
        other = block_keys(changed, 4)
        first = pos // 4
        assert other[:first] == keys[:first], pos
        assert all(a != b for a, b in zip(other[first:], keys[first:])), pos
    assert block_keys(prompt[:20] + [999], 4) == keys  # the partial block is no part of any key


def test_block_keys_equal_chain_key_block_by_block_and_refuse_ids_beyond_uint32():
    import random
    import struct

    rng = random.Random(7)
    for n, bs in ((0, 4), (3, 4), (37, 4), (8192, 16), (100, 1)):
        toks = [rng.randrange(2**32) for _ in range(n)]
        chained, parent = [], ROOT_KEY
        for i in range(n // bs):
            parent = chain_key(parent, toks[i * bs : (i + 1) * bs])
            chained.append(parent)
        assert block_keys(toks, bs) == chained, (n, bs)
    for bad in (-1, 2**32, 2**70):  # what chain_key's pack refuses, refused the same way
        with pytest.raises(struct.error):
            block_keys([1, 2, bad, 3], 4)
        with pytest.raises(struct.error):
            chain_key(ROOT_KEY, [1, 2, bad, 3])


def test_register_run_publishes_like_register_one_by_one():
    prompt = list(range(1, 30))  # 7 full blocks of 4
    keys = block_keys(prompt, 4)
    table = [10, 11, 12, 13, 14, 15, 16]
    one, run = (PrefixCache(BlockAllocator(32), 4) for _ in range(2))
    one.register(20, keys[1], keys[0], prompt[4:8])  # already cached elsewhere: kept, skipped
    run.register(20, keys[1], keys[0], prompt[4:8])
    _publish(one, table, prompt)
    run.register_run(table, keys, 0, 3, prompt)
    run.register_run(table, keys, 3, 7, prompt)
    assert one._entries == run._entries and one._by_key == run._by_key
    assert list(one._recent) == list(run._recent)
    assert run.match(prompt, keys) == [10, 20, 12, 13, 14, 15, 16]
    off = PrefixCache(BlockAllocator(32), 4, enabled=False)
    off.register_run(table, keys, 0, 7, prompt)
    assert off.num_cached_blocks == 0


def test_prefix_cache_reuse_eviction_and_collisions():
    alloc = BlockAllocator(8)  # 7 usable
    cache = PrefixCache(alloc, 4)
    prompt = list(range(1, 13))  # 3 full blocks
    table = cache.acquire([], 3)
    _publish(cache, table, prompt)
    assert cache.match(prompt, block_keys(prompt, 4)) == table[:2]  # never the whole prompt
    assert cache.match(prompt + [99], block_keys(prompt + [99], 4)) == table
    cache.free(table)  # evictable now, still matchable
    assert alloc.num_free == 7 and cache.num_cached_blocks == 3
    hits = cache.match(prompt + [99], block_keys(prompt + [99], 4))
    got = cache.acquire(hits, 1)
    assert got[:3] == table and all(alloc.refcount(b) == 1 for b in got)
    cache.free(got)
    # a forged entry whose tokens differ under the same key is a miss, not a wrong block
    other = [50, 51, 52, 53, 1]
    cache._by_key[block_keys(other, 4)[0]] = table[0]
    assert cache.match(other, block_keys(other, 4)) == []
    del cache._by_key[block_keys(other, 4)[0]]
    # allocating every block evicts the cached ones (their keys go)
    everything = cache.acquire([], 7)
    assert cache.num_cached_blocks == 0 and cache.recent_keys(10) == []
    assert cache.acquire([], 1) is None
    cache.free(everything)
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_usable


def test_prefix_cache_keys_differing_only_past_the_first_8_bytes_are_different_keys():
    # A 64-bit key would be the first 8 bytes: keys that agree there but not after must never
    # hit each other's blocks, even when the prompt's tokens are right.
    alloc = BlockAllocator(8)
    cache = PrefixCache(alloc, 4)
    prompt = list(range(1, 10))  # 2 full blocks and a last token
    keys = block_keys(prompt, 4)
    table = cache.acquire([], 3)
    _publish(cache, table, prompt)
    assert cache.match(prompt, keys) == table[:2]
    assert cache.recent_keys(10) == keys[::-1]  # the full 16-byte keys, newest first
    for i in range(2):
        twin = keys[i][:8] + bytes(b ^ 0xFF for b in keys[i][8:])
        assert len(twin) == 16 and twin != keys[i]
        assert cache.match(prompt, [*keys[:i], twin, *keys[i + 1 :]]) == table[:i]
    cache.free(table)
    # a block whose parent key agrees with block 0's in the first 8 bytes only: the parent
    # check compares all 16, so block 1 is a miss although its own key and tokens match
    fresh = PrefixCache(BlockAllocator(4), 4)
    t = fresh.acquire([], 2)
    twin0 = keys[0][:8] + bytes(b ^ 0xFF for b in keys[0][8:])
    assert fresh.register(t[0], keys[0], ROOT_KEY, prompt[:4])
    assert fresh.register(t[1], keys[1], twin0, prompt[4:8])
    assert fresh.match(prompt, keys) == t[:1]
    fresh.free(t)
    for a in (alloc, fresh.allocator):
        a.check_integrity()
        assert a.num_free == a.num_usable


def test_prefix_cache_keys_most_recent_first_and_disabled_mode():
    alloc = BlockAllocator(16)
    cache = PrefixCache(alloc, 2)
    a, b = [1, 2, 3, 4, 5], [7, 8, 9]
    ta, tb = cache.acquire([], 3), cache.acquire([], 2)
    _publish(cache, ta, a)
    _publish(cache, tb, b)
    ka, kb = block_keys(a, 2), block_keys(b, 2)
    assert cache.recent_keys(10) == [kb[0], ka[1], ka[0]]
    cache.free(cache.acquire(cache.match(a, ka), 1))  # a hit refreshes a's first block
    assert cache.recent_keys(10) == [ka[1], ka[0], kb[0]]
    cache.free(ta)
    cache.free(tb)
    off = PrefixCache(BlockAllocator(4), 2, enabled=False)
    t = off.acquire([], 1)
    key = block_keys([1, 2], 2)[0]
    assert not off.register(t[0], key, ROOT_KEY, [1, 2]) and off.match([1, 2, 3], [key]) == []


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
        rid, prompt, SamplingParams(), 30.0, block_keys(prompt, 4), loop.create_future()
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
