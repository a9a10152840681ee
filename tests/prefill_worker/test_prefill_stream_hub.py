"""The prefill side of a streamed hand-over, in process (no UCX): what the listener would send
for a request attached before it arrives (every layer of every block, layer by layer as each
chunk is computed, then the first token and the lease), for a prefix-cache hit (its cached blocks
first, all layers at once), after the prompt finished (everything from the lease), and after
an abort (ABORTED). Delivery releases the lease; every block is free at the end."""

from __future__ import annotations

import asyncio

import pytest
from prefill_helpers import (
    assert_all_free,
    drain_stream,
    serving,
    stream_coverage,
    wait_until,
    worker_config,
)

from splitserve.kvtransfer.server import LeaseLookupError
from splitserve.protos import kv_pb2
from splitserve.request.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TOKEN = "5eb0c1a1d8e14f0e9c3a7d2b6f4e8a10"  # the router's per-request stream secret
PROMPT = [1] + [(5 * i) % 300 + 3 for i in range(49)]  # 50 tokens: 13 blocks, 4 chunks of 16


def test_stream_feed_covers_every_layer_of_every_block(tiny_llama):
    async def body():
        async with serving(worker_config(tiny_llama, budget=16)) as (worker, _):
            engine, hub = worker.engine, worker.engine.stream_hub
            layers, nblocks = hub.num_layers, -(-len(PROMPT) // 4)
            everything = {(la, b) for la in range(layers) for b in range(nblocks)}
            # attached before the Prefill arrives: it waits for it
            attach = asyncio.create_task(hub.begin_stream("early", len(PROMPT), TOKEN))
            result = await engine.prefill("early", PROMPT, PARAMS, 30.0, stream_token=TOKEN)
            pieces, end = await drain_stream(await attach)
            assert stream_coverage(pieces) == everything
            assert len(pieces) >= 4 * layers  # per layer, per chunk: streamed as computed
            assert end.status == kv_pb2.KV_PULL_STATUS_OK and not end.finished
            assert (end.first_token_id, end.lease_id) == (
                result.first_token_id,
                result.lease.lease_id,
            )
            hub.end_stream("early", end.lease_id, delivered=True)  # releases the lease
            # a prefix-cache hit: its cached blocks go first, all layers in one piece
            hit = PROMPT[:40] + [7, 7, 7]
            attach = asyncio.create_task(hub.begin_stream("hit", len(hit), TOKEN))
            await engine.prefill("hit", hit, PARAMS, 30.0, stream_token=TOKEN)
            pieces, end = await drain_stream(await attach)
            first = pieces[0]
            assert (first.layer_start, first.layer_end, first.block_start) == (0, layers, 0)
            assert first.block_end == 10  # the 40 cached tokens
            assert stream_coverage(pieces) == {
                (la, b) for la in range(layers) for b in range(-(-len(hit) // 4))
            }
            # attached after the prompt finished: all of it from the lease, then the end
            late = await engine.prefill("late", PROMPT[:30], PARAMS, 30.0, stream_token=TOKEN)
            pieces, end = await drain_stream(await hub.begin_stream("late", 30, TOKEN))
            assert len(pieces) == 1 and stream_coverage(pieces) == {
                (la, b) for la in range(layers) for b in range(8)
            }
            assert end.lease_id == late.lease.lease_id
            hub.end_stream("late", end.lease_id, delivered=True)
            # not delivered (the decode side went away): the lease stays for the router
            hub.end_stream("hit", end.lease_id, delivered=False)
            assert engine.release_lease(
                next(iter(engine.leases._leases))  # noqa: SLF001 - the one lease left
            )
            # aborted while attached: the stream ends ABORTED
            attach = asyncio.create_task(hub.begin_stream("gone", len(PROMPT), TOKEN))
            call = asyncio.create_task(
                engine.prefill("gone", PROMPT, PARAMS, 30.0, stream_token=TOKEN)
            )
            feed = await attach
            await wait_until(lambda: engine.scheduler.find("gone") is not None)
            engine.abort("gone")
            _, end = await drain_stream(feed)
            assert end.status == kv_pb2.KV_PULL_STATUS_ABORTED
            hub.end_stream("gone", "", delivered=False)
            [err] = await asyncio.gather(call, return_exceptions=True)
            assert "aborted" in str(err)
            await wait_until(lambda: not engine.scheduler.running)  # freed after its step
            assert not hub.feeds
            assert_all_free(engine)

    asyncio.run(body())


def test_a_lease_dropped_mid_stream_ends_it_aborted_without_its_pieces(tiny_llama):
    async def body():
        async with serving(worker_config(tiny_llama, budget=16)) as (worker, _):
            engine, hub = worker.engine, worker.engine.stream_hub
            done = await engine.prefill("slow", PROMPT[:30], PARAMS, 30.0, stream_token=TOKEN)
            feed = await hub.begin_stream("slow", 30, TOKEN)  # late attach: pieces + OK end queued
            assert not feed.queue.empty()
            assert engine.release_lease(done.lease.lease_id)  # (or its expiry): blocks freed
            pieces, end = await drain_stream(feed)
            assert pieces == []  # none names a freed block
            assert end.status == kv_pb2.KV_PULL_STATUS_ABORTED
            hub.end_stream("slow", end.lease_id, delivered=False)
            assert not hub.feeds
            assert_all_free(engine)

    asyncio.run(body())


def test_a_stream_needs_the_requests_token(tiny_llama):
    """The request id is no secret: a streamed pull must present the token the router gave the
    prefill worker with the request; a wrong or missing one, or any for a request that came
    without one, is answered like an unknown request, and the real stream is unharmed."""

    async def body():
        async with serving(worker_config(tiny_llama, budget=16)) as (worker, _):
            engine, hub = worker.engine, worker.engine.stream_hub
            done = await engine.prefill("t", PROMPT[:30], PARAMS, 30.0, stream_token=TOKEN)
            for wrong in ("", TOKEN[:-1] + "1", TOKEN + "0"):
                with pytest.raises(LeaseLookupError) as info:
                    await hub.begin_stream("t", 30, wrong)
                assert info.value.status == kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN
            pieces, end = await drain_stream(await hub.begin_stream("t", 30, TOKEN))
            assert pieces and end.status == kv_pb2.KV_PULL_STATUS_OK
            hub.end_stream("t", end.lease_id, delivered=True)
            plain = await engine.prefill("plain", PROMPT[:30], PARAMS, 30.0)  # no token: no stream
            with pytest.raises(LeaseLookupError):
                await hub.begin_stream("plain", 30, "")
            assert engine.release_lease(plain.lease.lease_id)
            assert done.lease is not None and not hub.feeds
            assert_all_free(engine)

    asyncio.run(body())
