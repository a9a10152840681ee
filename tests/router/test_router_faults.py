"""Worker failures, with real processes killed by SIGKILL: a prefill that fails UNAVAILABLE is
retried once on another worker; a dead worker is evicted and gets requests again once it is
back; a decode worker that dies mid-stream gives the client UNAVAILABLE after the tokens it
already has, never a replay. No KV stays held on the survivors."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers_procs import ProcessGroup
from router_helpers import (
    assert_workers_free,
    generate,
    greedy,
    ids_request,
    router_config,
    running_router,
    wait_until,
    worker_flags,
    worker_load,
)

from splitserve.protos import generate_pb2
from splitserve.request.sampling_params import SamplingParams

PROMPTS = [
    [1, 44, 45, 46, 200, 201, 202],
    [1, 50, 60, 70],
    [1] + list(range(300, 320)),
    [1, 7, 8, 9, 10],
]


@pytest.fixture
def procs(tmp_path):
    with ProcessGroup(tmp_path) as group:
        yield group


async def _health(address: str) -> dict[str, bool]:
    info = await _info(address)
    return {w.address: w.healthy for w in info.workers}


async def _info(address: str) -> generate_pb2.ServerInfo:
    from splitserve.protos import generate_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        return await generate_pb2_grpc.GenerateServiceStub(ch).GetServerInfo(
            generate_pb2.GetServerInfoRequest()
        )


def _check(results, oracle, n: int) -> None:
    for prompt, res in zip(PROMPTS, results):
        assert res.tokens == oracle(prompt, SamplingParams(temperature=0, max_tokens=n)).token_ids


def test_prefill_unavailable_is_retried_once_on_another_worker(cluster, oracle, procs, tiny_llama):
    spare = procs.prefill_worker(tiny_llama, *worker_flags())
    # probes far apart: the registry still believes in the spare when the requests reach it
    cfg = router_config(
        cluster.model,
        [cluster.prefill, spare.address],
        [cluster.decode],
        routing={"prefill_policy": "round_robin"},
        registry={"poll_interval_s": 60},
    )

    async def body():
        async with running_router(cfg) as (r, stub):
            await wait_until(
                lambda: all(w.healthy for w in r.registry.workers()),
                10,
                "both prefill workers healthy",
            )
            spare.kill()
            results = [await generate(stub, ids_request(p, greedy(6))) for p in PROMPTS[:2]]
            healthy = await _health(r.address)
            await assert_workers_free([cluster.prefill], [cluster.decode])
            return results, r.metrics.prefill_retries._value.get(), healthy

    results, retries, healthy = asyncio.run(body())
    _check(results, oracle, 6)
    assert (
        retries == 1
    )  # round robin sent one of the two to the dead worker; the other never tried it
    assert healthy == {cluster.prefill: True, spare.address: False, cluster.decode: True}


def test_killed_prefill_worker_is_evicted_and_returns_when_healthy(
    cluster, oracle, procs, tiny_llama
):
    second = procs.prefill_worker(tiny_llama, *worker_flags())
    port = second.port
    cfg = router_config(
        cluster.model,
        [cluster.prefill, second.address],
        [cluster.decode],
        routing={"prefill_policy": "round_robin"},
    )

    async def body():
        async with running_router(cfg) as (r, stub):
            await wait_until(
                lambda: all(w.healthy for w in r.registry.workers()),
                10,
                "both prefill workers healthy",
            )
            second.kill()
            await wait_until(
                lambda: not r.registry.get(second.address).healthy, 10, "the dead worker evicted"
            )
            served = await asyncio.gather(
                *(generate(stub, ids_request(p, greedy(6))) for p in PROMPTS)
            )
            retries = r.metrics.prefill_retries._value.get()
            again = procs.prefill_worker(
                tiny_llama, *worker_flags(), port=port
            )  # back on its address
            await wait_until(
                lambda: r.registry.get(again.address).healthy, 15, "the worker back in rotation"
            )
            back = [await generate(stub, ids_request(p, greedy(6))) for p in PROMPTS[:2]]
            load = await worker_load(again.address, "prefill")
            evictions = r.metrics.evictions("prefill")
            await assert_workers_free([cluster.prefill, again.address], [cluster.decode])
            return served, retries, back, load, evictions

    served, retries, back, load, evictions = asyncio.run(body())
    _check(served, oracle, 6)
    _check(back, oracle, 6)
    assert retries == 0 and sum(evictions.values()) == 1
    assert set(evictions) <= {"request_unavailable", "refused"}, evictions
    assert load.prefix_cache.num_cached_blocks > 0  # round robin gave it one of the two requests


async def _health_once_not_serving(stub, within_s: float = 10.0):
    """The router's health status, waited for until NOT_SERVING (the eviction updates it from a
    task of the router's loop, a moment after the failed stream's error went out)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        status = (await stub.Check(health_pb2.HealthCheckRequest())).status
        if status == health_pb2.HealthCheckResponse.NOT_SERVING or loop.time() > deadline:
            return status
        await asyncio.sleep(0.05)


def test_decode_worker_death_mid_stream_is_unavailable_after_the_tokens_sent(
    cluster, oracle, procs, tiny_llama
):
    doomed = procs.decode_worker(tiny_llama, *worker_flags())
    cfg = router_config(cluster.model, [cluster.prefill], [doomed.address])
    prompt = PROMPTS[0]

    async def body():
        async with running_router(cfg) as (r, stub):
            call = stub.Generate(ids_request(prompt, greedy(249, ignore_eos=True)), timeout=60)
            got = [await call.read() for _ in range(2)]
            doomed.kill()
            err = None
            try:
                while (msg := await call.read()) is not grpc.aio.EOF:
                    got.append(msg)
            except grpc.aio.AioRpcError as e:
                err = e
            async with grpc.aio.insecure_channel(r.address) as ch:
                status = await _health_once_not_serving(health_pb2_grpc.HealthStub(ch))
            await assert_workers_free([cluster.prefill])
            return got, err or await call.code(), status

    got, err, status = asyncio.run(body())
    assert isinstance(err, grpc.aio.AioRpcError), f"the stream ended with {err}"
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    tokens = [t for c in got for t in c.token_ids]
    assert f"failed after {len(tokens)} tokens were streamed" in err.details()
    assert "send the request again" in err.details()
    ref = oracle(prompt, SamplingParams(temperature=0, max_tokens=249, ignore_eos=True)).token_ids
    assert 2 <= len(tokens) < 249 and tokens == ref[: len(tokens)]
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # no decode worker left
