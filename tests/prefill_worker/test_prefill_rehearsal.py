"""The start-up rehearsal (prefill_worker/rehearsal.py): one request per token bucket up to the
largest step through the engine's request path before SERVING, leaving no trace (no metric, no cached
prefix, no lease, every block free) and no effect on what users get."""

from __future__ import annotations

import asyncio

import pytest
from prefill_helpers import GREEDY, prefill_request, release, serving, worker_config

from splitserve.prefill_worker.config import PrefillFaults
from splitserve.prefill_worker.prefill_step import register_full_blocks
from splitserve.prefill_worker.prefix_cache import PrefixCache
from splitserve.prefill_worker.rehearsal import REHEARSAL_ID, rehearsal_sizes, rehearsal_tokens
from splitserve.request.block_allocator import BlockAllocator

PROMPT = [5, 17, 3, 99, 42, 7, 250, 11, 64, 8, 1, 300, 77]


def _count(engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name) or 0.0


async def _first_tokens(cfg) -> tuple[int, list[int]]:
    async with serving(cfg) as (worker, stub):
        engine = worker.engine
        ran = engine.rehearsal_sizes
        assert engine.progress == len(ran)  # each rehearsal request ran its own step
        assert float(engine.runner.kv_cache.abs().sum()) == 0.0  # zeroed after the rehearsal
        # no trace: nothing counted, nothing cached, no lease, no block held (serving() checks
        # the blocks again at the end, after the user's requests)
        assert _count(engine, "splitserve_prefill_step_seconds_count") == 0
        assert _count(engine, "splitserve_prefill_prompt_tokens_total") == 0
        assert engine.cache.num_cached_blocks == 0 and engine.cache.enabled
        assert len(engine.leases) == 0
        assert engine.allocator.num_free == engine.allocator.num_usable
        firsts = []
        for i in range(2):  # the second one hits the first one's cached prefix
            resp = await stub.Prefill(prefill_request(f"u{i}", PROMPT, GREEDY))
            firsts.append(resp.first_token_id)
            await release(stub, resp)
        assert _count(engine, "splitserve_prefill_step_seconds_count") == 2
        assert engine.cache.num_cached_blocks > 0  # the users' blocks are cached as before
        return ran, firsts


def test_rehearsal_runs_the_largest_step_and_leaves_no_trace(tiny_llama):
    on = worker_config(tiny_llama, max_model_len=96, budget=64, warmup=True, rehearsal=True)
    off = worker_config(tiny_llama, max_model_len=96, budget=64, warmup=True, rehearsal=False)
    ran, with_rehearsal = asyncio.run(_first_tokens(on))
    assert ran == [64, 32, 16]  # buckets up to min(max_model_len - 2, budget, the pool)
    not_ran, without = asyncio.run(_first_tokens(off))
    assert not_ran == []
    assert with_rehearsal == without  # the rehearsal's KV and state do not leak into a reply


def test_rehearsal_is_capped_by_model_length_and_pool():
    class _Engine:  # only what rehearsal_tokens reads
        def __init__(self, max_len, budget, free, bs):
            self.max_model_len = max_len
            self.cfg = type("C", (), {})()
            self.cfg.engine = type("E", (), {})()
            self.cfg.engine.scheduler = type("S", (), {"max_num_batched_tokens": budget})()
            self.runner = type("R", (), {"block_size": bs})()
            self.allocator = type("A", (), {"num_free": free})()

    assert rehearsal_tokens(_Engine(4096, 8192, 10_000, 16)) == 4094  # the model length
    assert rehearsal_tokens(_Engine(131072, 8192, 10_000, 16)) == 8192  # the step budget
    assert rehearsal_tokens(_Engine(131072, 8192, 9, 16)) == 128  # the pool, one block spare
    assert rehearsal_tokens(_Engine(131072, 8192, 1, 16)) == 0  # nothing fits: skipped


def test_rehearsal_defaults_to_cuda_only_and_a_user_id_cannot_collide(tiny_llama):
    async def body():
        cfg = worker_config(tiny_llama, max_model_len=64, warmup=True)
        assert cfg.rehearsal is None
        async with serving(cfg) as (worker, stub):
            assert worker.engine.rehearsal_sizes == []  # CPU: skipped by default
            # the rehearsal's id is an ordinary id once start-up is over
            resp = await stub.Prefill(prefill_request(REHEARSAL_ID, PROMPT, GREEDY))
            await release(stub, resp)

    asyncio.run(body())


@pytest.mark.parametrize("num_blocks", [3, 40])
def test_rehearsal_fits_a_small_pool(tiny_llama, num_blocks):
    async def body():
        cfg = worker_config(
            tiny_llama, num_blocks=num_blocks, max_model_len=256, warmup=True, rehearsal=True
        )
        async with serving(cfg) as (worker, stub):
            engine = worker.engine
            assert engine.rehearsal_sizes == rehearsal_sizes(engine)
            assert engine.rehearsal_sizes[0] == min(254, (engine.allocator.num_usable - 1) * 4)
            resp = await stub.Prefill(prefill_request("u", PROMPT[:5], GREEDY))
            await release(stub, resp)

    asyncio.run(body())


def test_test_faults_never_slow_the_rehearsal():
    faults = PrefillFaults(last_chunk_delay_s=0.5)  # an empty prefix: every request is hit
    assert faults.slow_last_chunk(["user-1"]) == 0.5
    assert faults.slow_last_chunk([REHEARSAL_ID]) == 0.0
    assert faults.slow_last_chunk([REHEARSAL_ID, "user-1"]) == 0.5


def test_a_sequence_queued_without_block_keys_publishes_nothing():
    """Queued while the prefix cache was off (the rehearsal), finished after it is back on."""
    cache = PrefixCache(BlockAllocator(16), 4)
    seq = type("Seq", (), {})()
    seq.num_computed, seq.num_registered, seq.block_keys = 12, 0, []
    seq.block_table, seq.prompt = [1, 2, 3], list(range(12))
    register_full_blocks(cache, seq, 4)
    assert cache.num_cached_blocks == 0 and seq.num_registered == 0


def test_the_pool_is_zeroed_once_per_start_up(tiny_llama, zero_kv_calls):
    """Once, after the rehearsal when one runs (tensor-parallel followers freeze their heap on
    it)."""
    calls = zero_kv_calls

    async def body():
        for rehearsal in (True, False):
            calls.clear()
            cfg = worker_config(tiny_llama, max_model_len=64, warmup=True, rehearsal=rehearsal)
            async with serving(cfg) as (worker, _stub):
                assert len(calls) == 1, rehearsal
                assert bool(worker.engine.rehearsal_sizes) == rehearsal
                assert float(worker.engine.runner.kv_cache.abs().sum()) == 0.0

    asyncio.run(body())


def test_the_rehearsal_runs_through_the_workers_own_path(tiny_llama, monkeypatch):
    """After the KV listener and the streamed hand-over's layer hook are attached, as a user's
    first prompt meets them; the hub keeps nothing of it."""
    from splitserve.prefill_worker import kv_stream

    seen = []  # at each layer the hook reports: was the KV listener listening?
    original = kv_stream.StreamHub.on_layer_kv

    def on_layer_kv(hub, layer):
        kv_server = hub.on_added.__self__  # serve_hub: the listener's expect_pull
        seen.append(kv_server._listener is not None)
        return original(hub, layer)

    monkeypatch.setattr(kv_stream.StreamHub, "on_layer_kv", on_layer_kv)

    async def body():
        cfg = worker_config(tiny_llama, max_model_len=64, warmup=True, rehearsal=True)
        assert cfg.kv_transfer.streaming  # the default
        async with serving(cfg) as (worker, _stub):
            sizes = worker.engine.rehearsal_sizes
            assert sizes and len(seen) >= len(sizes) and all(seen)
            hub = worker.engine.stream_hub
            assert not hub.done and not hub.feeds  # no trace of the rehearsal's requests
            assert float(worker.engine.runner.kv_cache.abs().sum()) == 0.0

    asyncio.run(body())
