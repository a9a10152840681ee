"""Leases, aborts, cancellation, a full pool, drain and a failing forward: every path gives
its blocks back exactly once."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prefill_helpers import (
    assert_all_free,
    prefill_request,
    release,
    serving,
    wait_until,
    worker_config,
)

from splitserve.protos import generate_pb2, worker_pb2
from splitserve.request.block_hash import block_keys

LONG = [1] + [(7 * i) % 500 + 3 for i in range(199)]  # 200 tokens: 50 chunks at budget 4


def _metric(worker, name: str) -> float:
    return worker.metrics.registry.get_sample_value(name) or 0.0


def _slow_steps(worker, seconds: float = 0.01) -> None:
    """Each model step takes at least `seconds`, so a test can act while a prompt is mid-chunks."""
    forward = worker.engine.runner.prefill

    def slow(chunks):
        time.sleep(seconds)
        return forward(chunks)

    worker.engine.runner.prefill = slow


def test_uncollected_lease_expires_and_frees(tiny_llama):
    async def body():
        async with serving(worker_config(tiny_llama)) as (worker, stub):
            resp = await stub.Prefill(prefill_request("e", [1, 2, 3, 4, 5, 6, 7], lease_ttl_ms=150))
            assert resp.kv.ttl_ms == 150 and resp.kv.lease_id
            assert (await stub.GetLoad(worker_pb2.GetLoadRequest())).leases_held == 1
            assert worker.engine.allocator.num_free == worker.engine.allocator.num_usable - 2
            await wait_until(lambda: len(worker.engine.leases) == 0, timeout=3)
            assert _metric(worker, "splitserve_kv_lease_expired_total") == 1
            late = await stub.ReleaseLease(
                worker_pb2.ReleaseLeaseRequest(lease_id=resp.kv.lease_id)
            )
            assert not late.released  # expired: not an error

    asyncio.run(body())


def test_release_is_idempotent_and_checks_the_request(tiny_llama):
    async def body():
        async with serving(worker_config(tiny_llama)) as (worker, stub):
            resp = await stub.Prefill(prefill_request("r", [1, 9, 8, 7, 6]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ReleaseLease(
                    worker_pb2.ReleaseLeaseRequest(lease_id=resp.kv.lease_id, request_id="x")
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await release(stub, resp)
            again = await stub.ReleaseLease(
                worker_pb2.ReleaseLeaseRequest(lease_id=resp.kv.lease_id)
            )
            unknown = await stub.ReleaseLease(worker_pb2.ReleaseLeaseRequest(lease_id="nope"))
            assert not again.released and not unknown.released
            # Abort of a request whose prefill finished drops its lease
            resp = await stub.Prefill(prefill_request("a", [1, 9, 8, 7, 6]))
            assert (await stub.Abort(generate_pb2.AbortRequest(request_id="a"))).found
            assert not (await stub.Abort(generate_pb2.AbortRequest(request_id="a"))).found
            assert _metric(worker, "splitserve_kv_lease_expired_total") == 0

    asyncio.run(body())


def test_first_token_that_finishes_keeps_no_lease(tiny_llama):
    async def body():
        async with serving(worker_config(tiny_llama)) as (worker, stub):
            prompt = [1, 5, 6, 7, 8, 9]
            one = await stub.Prefill(
                prefill_request(
                    "m", prompt, generate_pb2.SamplingParams(temperature=0, max_tokens=1)
                )
            )
            assert one.finish_reason == generate_pb2.FINISH_REASON_LENGTH and not one.HasField("kv")
            stop = await stub.Prefill(
                prefill_request(
                    "s",
                    prompt,
                    generate_pb2.SamplingParams(temperature=0, stop_token_ids=[one.first_token_id]),
                )
            )
            assert stop.finish_reason == generate_pb2.FINISH_REASON_STOP and not stop.HasField("kv")
            assert stop.stop_reason.stop_token_id == one.first_token_id
            assert len(worker.engine.leases) == 0

    asyncio.run(body())


def test_abort_mid_chunks_and_cancel_free_blocks(tiny_llama):
    async def body():
        async with serving(worker_config(tiny_llama, budget=4)) as (worker, stub):
            engine = worker.engine
            _slow_steps(worker)
            call = asyncio.ensure_future(stub.Prefill(prefill_request("long", LONG)))
            await wait_until(
                lambda: (s := engine.scheduler.find("long")) is not None and s.num_computed >= 8
            )
            assert (await stub.Abort(generate_pb2.AbortRequest(request_id="long"))).found
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.CANCELLED
            await wait_until(lambda: engine.allocator.num_free == engine.allocator.num_usable)
            # a client that goes away (cancel, deadline) frees its blocks too
            call = stub.Prefill(prefill_request("gone", LONG))
            await wait_until(
                lambda: (s := engine.scheduler.find("gone")) is not None and s.num_computed >= 8
            )
            call.cancel()
            await wait_until(lambda: engine.scheduler.find("gone") is None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(prefill_request("late", LONG), timeout=0.05)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_until(lambda: engine.scheduler.find("late") is None)
            await wait_until(lambda: engine.allocator.num_free == engine.allocator.num_usable)
            await release(
                stub, await stub.Prefill(prefill_request("ok", [1, 2, 3]))
            )  # still serving

    asyncio.run(body())


def _retry_after_ms(err: grpc.aio.AioRpcError) -> str | None:
    return next((v for k, v in err.trailing_metadata() or () if k == "retry-after-ms"), None)


def test_full_pool_queues_then_bounds_the_queue(tiny_llama):
    # 15 usable blocks of 4 tokens: one 60-token prompt fills the pool under its lease
    async def body():
        async with serving(worker_config(tiny_llama, num_blocks=16, max_queue_len=1)) as (
            worker,
            stub,
        ):
            engine = worker.engine
            hog_prompt = [1] + list(range(100, 159))
            hog = await stub.Prefill(prefill_request("hog", hog_prompt))
            assert engine.allocator.num_free == 0
            queued = asyncio.ensure_future(stub.Prefill(prefill_request("q", [1, 2, 3, 4, 5])))
            await wait_until(lambda: len(engine.scheduler.waiting) == 1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(prefill_request("over", [1, 2]))
            assert (
                err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                and "max_queue_len" in err.value.details()
            )
            assert 1000 <= int(_retry_after_ms(err.value)) <= 30_000  # waiting helps: a hint
            with pytest.raises(
                grpc.aio.AioRpcError
            ) as err:  # could never fit, even in an empty pool
                await stub.Prefill(prefill_request("huge", list(range(1, 80))))
            assert (
                err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                and "--num-blocks" in err.value.details()
            )
            assert _retry_after_ms(err.value) is None  # waiting cannot help: no hint
            load = await stub.GetLoad(worker_pb2.GetLoadRequest(max_prefix_hashes=100))
            assert (load.num_waiting, load.free_blocks, load.total_blocks, load.leases_held) == (
                1,
                0,
                15,
                1,
            )
            assert load.prefix_cache.num_cached_blocks == 15
            # the hog's 15 blocks, under the same 16-byte chained keys the router computes
            assert sorted(load.prefix_cache.block_keys) == sorted(block_keys(hog_prompt, 4))
            await release(stub, hog)  # frees the pool: the queued request runs
            await release(stub, await queued)
            # a queued request can be aborted before it gets any block
            hog = await stub.Prefill(prefill_request("hog2", [1] + list(range(200, 259))))
            queued = asyncio.ensure_future(stub.Prefill(prefill_request("q2", [1, 2, 3])))
            await wait_until(lambda: len(engine.scheduler.waiting) == 1)
            assert (await stub.Abort(generate_pb2.AbortRequest(request_id="q2"))).found
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await queued
            assert err.value.code() == grpc.StatusCode.CANCELLED
            await release(stub, hog)

    asyncio.run(body())


def test_drain_lets_in_flight_finish_then_refuses(tiny_llama):
    async def body():
        async with serving(worker_config(tiny_llama, budget=8), check_free=False) as (worker, stub):
            _slow_steps(worker)
            call = asyncio.ensure_future(stub.Prefill(prefill_request("inflight", LONG)))
            await wait_until(lambda: worker.engine.scheduler.find("inflight") is not None)
            await worker.server.drain(grace_s=10)
            resp = await call  # finished inside the grace period
            assert resp.kv.num_tokens == len(LONG)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(prefill_request("new", [1, 2]), timeout=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await worker.engine.stop()  # drops the lease nobody will collect
            assert_all_free(worker.engine)

    asyncio.run(body())


def test_failing_forward_is_fatal_unavailable_and_not_serving(tiny_llama):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def body():
        async with serving(worker_config(tiny_llama), check_free=False) as (worker, stub):

            def broken(chunks):
                raise RuntimeError("injected device fault")

            worker.engine.runner.prefill = broken
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(prefill_request("f", [1, 2, 3, 4, 5]))
            assert (
                err.value.code() == grpc.StatusCode.UNAVAILABLE
                and "injected" in err.value.details()
            )
            async with grpc.aio.insecure_channel(worker.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", "splitserve.v1.PrefillWorker"):
                    got = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(prefill_request("g", [1, 2]))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert_all_free(worker.engine)

    asyncio.run(body())


def test_duplicate_in_flight_request_id_is_rejected(tiny_llama):
    async def body():
        async with serving(worker_config(tiny_llama, budget=4)) as (worker, stub):
            _slow_steps(worker)
            first = asyncio.ensure_future(stub.Prefill(prefill_request("dup", LONG)))
            await wait_until(lambda: worker.engine.scheduler.find("dup") is not None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(prefill_request("dup", [1, 2, 3]))
            assert (
                err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                and "already in flight" in err.value.details()
            )
            await release(stub, await first)

    asyncio.run(body())


def test_two_pulls_of_one_lease_pin_and_unpin_once_each(tiny_llama):
    """A lease pulled twice at once (a decode worker's retry while its first pull still runs):
    each pull pins the blocks once and gives its pin back, whichever ends first; the lease's
    own reference goes with the delivered pull, and every block is free at the end."""

    async def body():
        async with serving(worker_config(tiny_llama)) as (worker, stub):
            source = worker.kv_server.leases  # the listener's own lease source
            alloc = worker.engine.allocator
            resp = await stub.Prefill(prefill_request("twice", [1, 2, 3, 4, 5, 6, 7]))
            lease = resp.kv.lease_id
            blocks = source.begin_pull(lease, "twice")
            base = [alloc.refcount(b) - 1 for b in blocks]  # before any pull
            assert source.begin_pull(lease, "twice") == blocks
            assert [alloc.refcount(b) for b in blocks] == [r + 2 for r in base]
            source.end_pull(lease, delivered=False)  # the first attempt gave up
            assert [alloc.refcount(b) for b in blocks] == [r + 1 for r in base]
            assert len(worker.engine.leases) == 1  # the lease stays for the retry
            source.end_pull(lease, delivered=True)  # the retry delivered: lease released
            assert len(worker.engine.leases) == 0  # (serving() checks every block is free)

    asyncio.run(body())
