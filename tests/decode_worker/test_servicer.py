"""DecodeWorker over real grpc.aio in this process: streams equal isolated generation,
validation errors are INVALID_ARGUMENT, cancel and Abort free blocks, drain ends cleanly."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from decode_helpers import assert_all_free, collect_stream, decode_request, serving
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.kvtransfer.descriptor import PoolSpec, make_handle
from splitserve.protos import generate_pb2, kv_pb2, worker_pb2
from splitserve.request.detokenizer import IncrementalDetokenizer
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.stop_strings import StopStringMatcher
from splitserve.request.tokenizer import Tokenizer

PROMPTS = [[1, 17, 99, 230, 41], [1, 300, 301, 7, 8, 9, 10, 11, 12], [1, 450]]


async def _wait_until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_streams_match_isolated_generation(tiny_llama, oracle):
    async def main():
        async with serving(tiny_llama) as (worker, stub, channel):
            health = health_pb2_grpc.HealthStub(channel)
            got = await health.Check(
                health_pb2.HealthCheckRequest(service="splitserve.v1.DecodeWorker")
            )
            assert got.status == health_pb2.HealthCheckResponse.SERVING
            refs = [
                oracle(p, SamplingParams(temperature=0, max_tokens=10 + 3 * i))
                for i, p in enumerate(PROMPTS)
            ]
            reqs = [
                decode_request(
                    f"s{i}",
                    p,
                    r.token_ids[0],
                    temperature=0,
                    max_tokens=10 + 3 * i,
                    logprobs=1 if i == 1 else None,
                )
                for i, (p, r) in enumerate(zip(PROMPTS, refs))
            ]
            runner = (
                worker.engine.runner
            )  # a compatible handle whose listener is gone: pull fails, recomputed
            reqs[2].kv.CopyFrom(
                make_handle(
                    PoolSpec.of(runner.kv_cache, runner.compat_hash),
                    host="127.0.0.1",
                    port=1,
                    lease_id="lease-2",
                    request_id="s2",
                    num_blocks=-(-len(PROMPTS[2]) // 4),
                    num_tokens=len(PROMPTS[2]),
                    ttl_s=30,
                )
            )
            calls = [stub.Decode(r) for r in reqs]
            results = await asyncio.gather(*(collect_stream(c) for c in calls))
            for i, ((tokens, chunks), ref) in enumerate(zip(results, refs)):
                assert tokens == ref.token_ids[1:]
                assert chunks[-1].finish_reason == (
                    generate_pb2.FINISH_REASON_LENGTH
                    if ref.finish_reason == "length"
                    else generate_pb2.FINISH_REASON_STOP
                )
                assert all(not c.finish_reason for c in chunks[:-1])
                # the TTFT parts ride on the first chunk only; only s2 had a pull (failed, then recomputed)
                assert chunks[0].queue_time_ms > 0 and (chunks[0].transfer_time_ms > 0) == (i == 2)
                assert all(c.queue_time_ms == c.transfer_time_ms == 0 for c in chunks[1:])
                # its decode queue is part of queue_time_ms; the prefill worker sampled token 1
                assert 0 <= chunks[0].admit_wait_ms <= chunks[0].queue_time_ms
                assert chunks[0].local_prefill_ms == 0
                n_lp = sum(len(c.logprobs) for c in chunks)
                assert n_lp == (len(tokens) if i == 1 else 0)
            load = await stub.GetLoad(worker_pb2.GetLoadRequest())
            assert load.role == generate_pb2.WORKER_ROLE_DECODE
            assert (load.num_running, load.num_waiting, load.free_blocks) == (
                0,
                0,
                load.total_blocks,
            )
            assert (
                load.block_size == 4 and load.model_compat_hash == worker.engine.runner.compat_hash
            )
            assert_all_free(worker.engine)

    asyncio.run(main())


def test_invalid_requests_are_refused_with_fix_hints(tiny_llama):
    async def main():
        async with serving(tiny_llama, num_blocks=16) as (worker, stub, _):
            bad = {
                "empty id": decode_request("", [1, 2], 3, temperature=0),
                "empty prompt": decode_request("x", [], 3, temperature=0),
                "token out of vocab": decode_request("x", [1, 9999], 3, temperature=0),
                "first token out of vocab": decode_request("x", [1, 2], 9999, temperature=0),
                "bad temperature": decode_request("x", [1, 2], 3, temperature=-1),
                "max_tokens past max_model_len": decode_request(
                    "x", [1, 2], 3, temperature=0, max_tokens=255
                ),
            }
            for what, req in bad.items():
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await collect_stream(stub.Decode(req))
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
                assert exc.value.details(), what
                if what.startswith("max_tokens"):  # refused, never clamped; both numbers named
                    assert "max_tokens = 255 does not fit" in exc.value.details()
                    assert "leaves 254" in exc.value.details()
            mismatched = decode_request("x", [1, 2], 3, temperature=0)
            mismatched.kv.CopyFrom(kv_pb2.KvHandle(lease_id="l1", block_size=16, num_tokens=2))
            with pytest.raises(
                grpc.aio.AioRpcError
            ) as exc:  # a deployment error, before any allocation
                await collect_stream(stub.Decode(mismatched))
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "block_size" in exc.value.details()
            runner = worker.engine.runner
            spec = PoolSpec.of(runner.kv_cache, runner.compat_hash)
            for port in (0, 70000):  # the proto says 1..65535: no connect attempt, no recompute
                handle = make_handle(
                    spec,
                    host="127.0.0.1",
                    port=port,
                    lease_id="l2",
                    request_id="p",
                    num_blocks=1,
                    num_tokens=2,
                    ttl_s=30,
                )
                req = decode_request("port", [1, 2], 3, temperature=0)
                req.kv.CopyFrom(handle)
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await collect_stream(stub.Decode(req))
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, port
                assert "1..65535" in exc.value.details()
            too_long = decode_request("big", [1] * 10, 3, temperature=0, max_tokens=200)
            with pytest.raises(grpc.aio.AioRpcError) as exc:  # 4-token blocks, pool of 15
                await collect_stream(stub.Decode(too_long))
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "num_blocks" in exc.value.details()
            md = exc.value.trailing_metadata() or ()
            assert all(k != "retry-after-ms" for k, _ in md)  # waiting cannot help: no hint
            assert_all_free(worker.engine)

    asyncio.run(main())


def test_stop_strings_are_matched_off_the_engine_thread(tiny_llama, oracle, monkeypatch):
    """The decode worker ends a stream at a stop string like the single-process engine, but
    the matching (and its detokenization) runs on the event loop: the engine thread only ends
    the sequence afterwards, with reason "stop"."""
    threads: list[str] = []
    feed = StopStringMatcher.feed

    def spy(self, piece, find=True):
        threads.append(threading.current_thread().name)
        return feed(self, piece, find)

    monkeypatch.setattr(StopStringMatcher, "feed", spy)
    prompt = PROMPTS[0]
    base = oracle(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(base.text) >= 6
    stop = base.text[3:6]
    # room to run far past the stop string: the engine must not end it by length first
    params = dict(temperature=0, max_tokens=200, ignore_eos=True, stop=[stop])
    ref = oracle(prompt, SamplingParams(**params))
    assert ref.finish_reason == "stop" and len(ref.token_ids) < 100
    # a stop string completed by the prefill's first token ends the stream before any token
    third = PROMPTS[2]
    first = oracle(third, SamplingParams(temperature=0, max_tokens=1)).token_ids[0]
    first_text = IncrementalDetokenizer(Tokenizer.from_dir(tiny_llama), third).add(first)
    assert first_text  # this prompt's first token has text of its own
    at_first = dict(params, stop=[first_text])
    assert oracle(third, SamplingParams(**at_first)).token_ids == [first]
    colocated = worker_pb2.DecodeRequest(  # no prefill: the worker samples the first token
        request_id="colo", prompt_token_ids=prompt, sampling=generate_pb2.SamplingParams(**params)
    )

    async def main():
        async with serving(tiny_llama) as (worker, stub, _):
            engine = worker.engine
            stopped = engine.metrics.registry.get_sample_value(
                "splitserve_decode_requests_finished_total", {"reason": "stop"}
            )
            got = await asyncio.gather(
                collect_stream(
                    stub.Decode(decode_request("str", prompt, ref.token_ids[0], **params))
                ),
                collect_stream(stub.Decode(colocated)),
                collect_stream(stub.Decode(decode_request("first", third, first, **at_first))),
            )
            for (tokens, chunks), want, reason in zip(
                got, (ref.token_ids[1:], ref.token_ids, []), (stop, stop, first_text)
            ):
                assert tokens == want
                assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
                assert chunks[-1].stop_reason.stop_str == reason
            await _wait_until(lambda: not engine.scheduler.by_id)
            await _wait_until(lambda: engine.load.free_blocks == engine.load.total_blocks)
            assert_all_free(engine)
            after = engine.metrics.registry.get_sample_value(
                "splitserve_decode_requests_finished_total", {"reason": "stop"}
            )
            assert after == (stopped or 0) + 3  # ended there as stopped, not as aborted

    asyncio.run(main())
    assert threads and "decode-engine" not in threads, set(threads)


def test_cancel_and_abort_free_blocks(tiny_llama):
    async def main():
        async with serving(tiny_llama, num_blocks=128) as (worker, stub, _):
            engine = worker.engine
            long = dict(temperature=0, max_tokens=200, ignore_eos=True)
            cancelled = stub.Decode(decode_request("c", PROMPTS[0], 5, **long))
            aborted = stub.Decode(decode_request("a", PROMPTS[1], 5, **long))
            it = cancelled.__aiter__()
            await it.__anext__()
            cancelled.cancel()
            chunks = []
            async for chunk in aborted:
                chunks.append(chunk)
                if len(chunks) == 2:
                    assert (await stub.Abort(generate_pb2.AbortRequest(request_id="a"))).found
            assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_ABORT
            assert not (await stub.Abort(generate_pb2.AbortRequest(request_id="a"))).found
            await _wait_until(lambda: not engine.scheduler.by_id)
            await _wait_until(lambda: engine.load.free_blocks == engine.load.total_blocks)
            assert_all_free(engine)

    asyncio.run(main())


def test_duplicate_request_id_and_drain(tiny_llama):
    async def main():
        async with serving(tiny_llama) as (worker, stub, channel):
            first = stub.Decode(
                decode_request("dup", PROMPTS[0], 5, temperature=0, max_tokens=50, ignore_eos=True)
            )
            it = first.__aiter__()
            await it.__anext__()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect_stream(
                    stub.Decode(decode_request("dup", PROMPTS[1], 5, temperature=0))
                )
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            health = health_pb2_grpc.HealthStub(channel)
            stopping = asyncio.ensure_future(worker.stop(grace_s=5.0))
            rest = [c async for c in first]  # the in-flight stream finishes within the grace period
            assert rest[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
            await stopping
            assert_all_free(worker.engine)
            with pytest.raises(grpc.aio.AioRpcError):
                await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)

    asyncio.run(main())


def test_deadline_frees_blocks(tiny_llama):
    async def main():
        async with serving(tiny_llama) as (worker, stub, _):
            call = stub.Decode(
                decode_request("d", PROMPTS[0], 5, temperature=0, max_tokens=240, ignore_eos=True),
                timeout=0.05,
            )
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect_stream(call)
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await _wait_until(lambda: not worker.engine.scheduler.by_id)
            await _wait_until(
                lambda: worker.engine.load.free_blocks == worker.engine.load.total_blocks
            )
            assert_all_free(worker.engine)

    asyncio.run(main())


def test_failing_step_is_fatal_unavailable_and_not_serving(tiny_llama):
    async def main():
        async with serving(tiny_llama) as (worker, stub, channel):

            def broken(n, variant=0):
                raise RuntimeError("injected device fault")

            worker.engine.graphs._body = broken
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect_stream(
                    stub.Decode(decode_request("f", PROMPTS[0], 5, temperature=0, max_tokens=20))
                )
            assert (
                exc.value.code() == grpc.StatusCode.UNAVAILABLE
                and "injected" in exc.value.details()
            )
            health = health_pb2_grpc.HealthStub(channel)
            req = health_pb2.HealthCheckRequest(service="splitserve.v1.DecodeWorker")
            deadline = time.monotonic() + 5
            while (await health.Check(req)).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as exc:  # later requests: refused at once
                await collect_stream(stub.Decode(decode_request("g", PROMPTS[1], 5, temperature=0)))
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert_all_free(worker.engine)

    asyncio.run(main())
