"""Streamed KV hand-over between real processes (router, prefill and decode workers over gRPC,
KV over UCX/TCP): the same tokens as the pull after the prefill and as the offline oracle, for
prompts of one chunk and of many (prefix-cache hits sent first); a full decode pool makes the
stream wait (backpressure), nothing lost; a stream broken between two layer groups falls back to
the pull with the same tokens. Every case ends with every block and lease free on both sides."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fault_helpers import metric, start_worker
from router_helpers import (
    assert_workers_free,
    generate,
    greedy,
    ids_request,
    read_rest,
    router_config,
    running_router,
)

from splitserve.protos import kv_pb2, worker_pb2, worker_pb2_grpc
from splitserve.request.sampling_params import SamplingParams

PROMPTS = [[1] + [(11 * i) % 500 + 3 for i in range(60)], [1, 44, 45, 46, 200, 201, 202]]
LONG = [1] + [(7 * i + 5) % 400 + 3 for i in range(150)]  # many chunks of 16 tokens


async def _run(model, prefill, decode, prompts, max_tokens, streaming=True, prefix="s"):
    cfg = router_config(model, [prefill], [decode], routing={"kv_streaming": streaming})
    async with running_router(cfg) as (_, stub):
        results = await asyncio.gather(
            *(
                generate(
                    stub, ids_request(p, greedy(max_tokens, ignore_eos=True), f"{prefix}{i}"), 60
                )
                for i, p in enumerate(prompts)
            )
        )
    await assert_workers_free([prefill], [decode])
    return results


def _want(oracle, prompt, n):
    return oracle(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)).token_ids


def test_streamed_and_pulled_handovers_give_the_oracle_tokens(cluster, oracle, procs):
    # chunks of 16 tokens: LONG takes ten prefill steps
    p, pm = start_worker(procs, "prefill", cluster.model, None, "--max-num-batched-tokens", "16")
    prefill, decode = p.address, cluster.decode
    prompts = [*PROMPTS, LONG]
    hit = [LONG[:120] + [9, 9, 9]]  # after LONG: its cached prefix blocks go first in the stream
    streamed = asyncio.run(_run(cluster.model, prefill, decode, prompts, 12))
    streamed += asyncio.run(_run(cluster.model, prefill, decode, hit, 12, prefix="hit"))
    pulled = asyncio.run(_run(cluster.model, prefill, decode, prompts + hit, 12, False, "p"))
    for p, s, q in zip(prompts + hit, streamed, pulled):
        assert s.tokens == q.tokens == _want(oracle, p, 12)
        assert s.last.kv_handover.streamed and not s.last.kv_handover.recomputed
        assert not q.last.kv_handover.streamed and not q.last.kv_handover.recomputed
    assert streamed[-1].last.usage.cached_prompt_tokens >= 100  # the prefix-cache hit
    assert metric(pm, "splitserve_prefill_stream_attach_wait_seconds_count") >= len(streamed)


def test_full_decode_pool_makes_streams_wait_nothing_lost(cluster, oracle, procs):
    # 15 usable blocks of 4 tokens: one 61-token prompt (16 blocks + growth) does not fit next
    # to another; four at once must wait for each other's blocks
    prefill, _ = start_worker(procs, "prefill", cluster.model, None, wait=False)
    decode, dm = start_worker(procs, "decode", cluster.model, None, num_blocks=24, wait=False)
    prefill.wait_serving()
    decode.wait_serving()
    prompts = [[1] + [(13 * i + k) % 300 + 3 for i in range(40)] for k in range(4)]
    results = asyncio.run(_run(cluster.model, prefill.address, decode.address, prompts, 8))
    for p, r in zip(prompts, results):
        assert r.tokens == _want(oracle, p, 8)
    assert metric(dm, "splitserve_decode_kv_reserve_waits_total") > 0
    assert all(r.last.kv_handover.streamed for r in results)
    # the wait is each request's own figure: the first to reserve had room at once (0), a later
    # one waited; inside its transfer, and beside the gap's parts rather than one of them
    waits = sorted(r.last.timings.reserve_wait_ms for r in results)
    assert waits[0] == 0 and waits[-1] > 0, waits
    for r in results:
        t = r.last.timings
        assert t.reserve_wait_ms <= r.last.kv_handover.transfer_ms + 0.01, (t, r.last.kv_handover)


def test_64_concurrent_streamed_handovers_all_stream(cluster, oracle, procs, monkeypatch):
    # more streams than a peer's endpoint cap (16): the rest queue for an endpoint and attach
    # late (catching up on what is computed), none times out, none recomputes; over TCP (the
    # path between hosts: this prefill worker offers UCX nothing else)
    monkeypatch.setenv("UCX_TLS", "tcp")
    prefill, _ = start_worker(procs, "prefill", cluster.model, None)
    prompts = [[1] + [200 + (7 * i + j) % 300 for j in range(5 + i % 9)] for i in range(64)]
    results = asyncio.run(_run(cluster.model, prefill.address, cluster.decode, prompts, 4))
    for p, r in zip(prompts, results):
        assert r.tokens == _want(oracle, p, 4)
        assert r.last.kv_handover.streamed and not r.last.kv_handover.recomputed


def test_a_pool_that_stays_full_falls_back_to_the_pull(cluster, oracle, procs):
    # 15 usable blocks of 4 tokens: A (44 + 4 tokens: 12 blocks from its admission on, none
    # more) holds them for 4 decode steps of 50 ms (a test-only step delay); B's 20-token prompt
    # (5 blocks) does not fit beside it: B's stream waits 10 ms for room, gives up (pool_full),
    # and the pull after the prefill serves it (here by recomputing once A is done). The engine
    # meanwhile waits with requests queued and blocks reserved (it once took that for a stall)
    prefill, _ = start_worker(procs, "prefill", cluster.model, None, wait=False)
    small, _ = start_worker(
        procs, "decode", cluster.model, {"step_delay_s": 0.05, "request_id_prefix": "A"},
        num_blocks=16, wait=False, kv_transfer={"stream_reserve_wait_s": 0.01},
    )  # fmt: skip
    prefill.wait_serving()
    small.wait_serving()
    a_prompt = [1] + [(3 * i) % 300 + 3 for i in range(43)]
    b_prompt = [1] + [(5 * i) % 300 + 7 for i in range(19)]

    async def body():
        cfg = router_config(cluster.model, [prefill.address], [small.address])
        async with running_router(cfg) as (_, stub):
            call = stub.Generate(ids_request(a_prompt, greedy(4, ignore_eos=True), "A"), timeout=60)
            first = await call.read()  # A's blocks are reserved on `small`
            b = await generate(stub, ids_request(b_prompt, greedy(8, ignore_eos=True), "B"), 60)
            rest = await read_rest(call)
        await assert_workers_free([prefill.address], [small.address])
        return [first, *rest], b

    a_chunks, b = asyncio.run(body())
    assert [t for c in a_chunks for t in c.token_ids] == _want(oracle, a_prompt, 4)
    assert b.tokens == _want(oracle, b_prompt, 8)
    assert b.last.kv_handover.stream_fallback == "pool_full" and not b.last.kv_handover.streamed
    # B's failed stream waited its 10 ms for blocks; A found them free
    assert b.last.timings.reserve_wait_ms >= 10, b.last.timings


def test_stream_broken_between_layer_groups_falls_back_to_the_pull(cluster, oracle, procs):
    faults = {"transfer": {"stream_break_after_pieces": 1, "request_id_prefix": "brk"}}
    prefill, _ = start_worker(procs, "prefill", cluster.model, faults, wait=False)
    decode, dm = start_worker(procs, "decode", cluster.model, None, wait=False)
    prefill.wait_serving()
    decode.wait_serving()
    results = asyncio.run(
        _run(cluster.model, prefill.address, decode.address, PROMPTS, 10, prefix="brk")
    )
    for p, r in zip(PROMPTS, results):
        assert r.tokens == _want(oracle, p, 10)
        hand = r.last.kv_handover
        assert hand.stream_fallback == "peer_failed" and not hand.streamed, hand
        # the pull after the fallback lies in the second token's gap, as the router splits it
        assert r.last.timings.handover_ms >= hand.transfer_ms - 0.01, r.last.timings
    assert metric(dm, "splitserve_kv_transfer_failures_total", reason="peer_failed") >= 2


def test_first_token_that_ends_the_request_cancels_the_streamed_decode(cluster, oracle):
    prompt = [1, 50, 60, 70]
    ref = oracle(prompt, SamplingParams(temperature=0, max_tokens=8))
    stop = oracle.tokenizer.decode(ref.token_ids[:1])

    async def body():
        cfg = router_config(cluster.model, [cluster.prefill], [cluster.decode])
        async with running_router(cfg) as (_, stub):
            one = await generate(stub, ids_request(prompt, greedy(1), "end-len"))
            by_stop = await generate(stub, ids_request(prompt, greedy(8, stop=[stop]), "end-stop"))
        await assert_workers_free([cluster.prefill], [cluster.decode])
        return one, by_stop

    one, by_stop = asyncio.run(body())
    for res in (one, by_stop):
        assert len(res.chunks) == 1 and res.tokens == ref.token_ids[:1]
        assert res.last.usage.completion_tokens == 1


def test_bad_kv_stream_requests_get_a_clear_status_and_hold_nothing(cluster):
    stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(cluster.decode))
    load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    assert load.kv_streaming
    good = worker_pb2.KvStreamSource(
        address=kv_pb2.UcxAddress(host="127.0.0.1", port=1),
        model_compat_hash=load.model_compat_hash,
    )
    cases = [
        (
            dict(kv_stream=good, first_token_id=5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "first_token_id",
        ),
        (
            dict(kv_stream=worker_pb2.KvStreamSource(model_compat_hash=load.model_compat_hash)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "address",
        ),  # fmt: skip
        (
            dict(kv_stream=worker_pb2.KvStreamSource(address=good.address, model_compat_hash="x")),
            grpc.StatusCode.FAILED_PRECONDITION,
            "model_compat_hash",
        ),  # fmt: skip
    ]
    for fields, code, word in cases:
        req = worker_pb2.DecodeRequest(
            request_id="bad-stream", prompt_token_ids=[1, 2, 3], sampling=greedy(4), **fields
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(req, timeout=30))
        assert err.value.code() == code and word in err.value.details(), err.value.details()
    asyncio.run(assert_workers_free([], [cluster.decode]))


def test_corrupt_stream_then_failed_pull_recomputes_or_fails_per_policy(cluster, oracle, procs):
    # a corrupted stream piece fails its checksum, so does the pull it falls back to: then the
    # policy decides
    faults = {"transfer": {"corrupt_payload": True}}
    prefill, _ = start_worker(procs, "prefill", cluster.model, faults, wait=False)
    again, _ = start_worker(procs, "decode", cluster.model, None, wait=False)
    strict, _ = start_worker(
        procs, "decode", cluster.model, None, "--kv-failure-policy", "fail", wait=False
    )
    for w in (prefill, again, strict):
        w.wait_serving()
    prompt = PROMPTS[0]
    [recomputed] = asyncio.run(_run(cluster.model, prefill.address, again.address, [prompt], 6))
    assert recomputed.tokens == _want(oracle, prompt, 6)
    hand = recomputed.last.kv_handover
    assert (hand.stream_fallback, hand.recomputed, hand.reason) == ("checksum", True, "checksum")

    async def failed():
        cfg = router_config(cluster.model, [prefill.address], [strict.address])
        async with running_router(cfg) as (_, stub):
            req = ids_request(prompt, greedy(6, ignore_eos=True), "strict")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(stub, req, 60)
        await assert_workers_free([prefill.address], [strict.address])
        return err.value

    err = asyncio.run(failed())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "checksum" in err.details(), err.details()
