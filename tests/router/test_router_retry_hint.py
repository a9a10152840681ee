"""RESOURCE_EXHAUSTED through the router, from a real prefill worker with a small pool and a
queue of one: a full queue carries the worker's retry hint to the client (gRPC trailing metadata
`retry-after-ms`, HTTP 429 with `Retry-After`); a prompt too big for the whole pool carries none,
since retrying cannot help. The queued request is served once the pool frees up, and every
block is free at the end."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import grpc
import pytest
from helpers_procs import ProcessGroup
from router_helpers import (
    assert_workers_free,
    generate,
    greedy,
    ids_request,
    router_config,
    rpc_error,
    running_router,
    wait_until,
    worker_flags,
    worker_load,
)

from splitserve.protos import worker_pb2, worker_pb2_grpc
from splitserve.request.sampling_params import SamplingParams

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
HOG = [1] + list(range(100, 159))  # 60 tokens: all 15 usable blocks of 4
SHORT = [1, 2, 3]
TOO_BIG = list(range(1, 71))  # 18 blocks: more than the whole pool


@pytest.fixture
def procs(tmp_path):
    with ProcessGroup(tmp_path) as group:
        yield group


def _retry_after_ms(err: grpc.aio.AioRpcError) -> str | None:
    return next((v for k, v in err.trailing_metadata() or () if k == "retry-after-ms"), None)


def _worker_metadata():
    secret = os.environ.get("SPLITSERVE_CLUSTER_SECRET")  # workers started with one need it
    return (("authorization", f"Bearer {secret}"),) if secret else None


async def _completion(router, prompt: list[int]) -> tuple[int, dict, dict]:
    url = f"{router.http.scheme}://{router.http.address}/v1/completions"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json={"prompt": prompt, "max_tokens": 4}) as resp,
    ):
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


def test_full_queue_gives_a_retry_hint_and_a_request_too_big_for_the_pool_none(
    cluster, oracle, procs, tiny_llama
):
    config = procs.log_dir / "small-queue.yaml"
    config.write_text("engine:\n  scheduler: {max_queue_len: 1}\n")
    small = procs.prefill_worker(tiny_llama, *worker_flags(num_blocks=16), "--config", str(config))
    cfg = router_config(cluster.model, [small.address], [cluster.decode], http={"port": 0})

    async def body():
        async with (
            running_router(cfg) as (router, stub),
            grpc.aio.insecure_channel(small.address) as ch,
        ):
            worker = worker_pb2_grpc.PrefillWorkerStub(ch)
            md = _worker_metadata()
            hog = await worker.Prefill(
                worker_pb2.PrefillRequest(
                    request_id="hog", prompt_token_ids=HOG, sampling=greedy(2, ignore_eos=True)
                ),
                metadata=md,
            )
            assert hog.kv.lease_id  # its lease holds every block
            queued = asyncio.ensure_future(generate(stub, ids_request(SHORT, greedy(4))))

            async def waiting() -> bool:
                return (await worker_load(small.address, "prefill")).num_waiting == 1

            await wait_until(waiting, what="the short request queued")
            full = await rpc_error(generate(stub, ids_request(SHORT, greedy(4))))
            too_big = await rpc_error(generate(stub, ids_request(TOO_BIG, greedy(4))))
            http_full = await _completion(router, SHORT)
            http_too_big = await _completion(router, TOO_BIG)
            assert not queued.done()
            released = await worker.ReleaseLease(
                worker_pb2.ReleaseLeaseRequest(lease_id=hog.kv.lease_id, request_id="hog"),
                metadata=md,
            )
            assert released.released
            served = await queued
            await assert_workers_free([small.address], [cluster.decode])
        return full, too_big, http_full, http_too_big, served

    full, too_big, http_full, http_too_big, served = asyncio.run(body())
    assert small.stop() == 0, small.log()
    assert full.code() == EXHAUSTED and "prefill queue is full" in full.details()
    assert 1000 <= int(_retry_after_ms(full)) <= 30_000  # request/retry_hint.py's bounds
    assert too_big.code() == EXHAUSTED and "--num-blocks" in too_big.details()
    assert _retry_after_ms(too_big) is None
    status, doc, headers = http_full
    assert status == 429 and "prefill queue is full" in doc["error"]["message"], doc
    assert 1 <= int(headers["Retry-After"]) <= 30
    status, doc, headers = http_too_big
    assert status == 429 and "--num-blocks" in doc["error"]["message"], doc
    assert "Retry-After" not in headers
    want = oracle(SHORT, SamplingParams(temperature=0, max_tokens=4)).token_ids
    assert served.tokens == want
