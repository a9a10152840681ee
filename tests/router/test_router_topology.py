"""The issue's topology: one router over two prefill and two decode workers, every one a real
process on loopback. Concurrent streamed requests return exactly the single-process greedy
tokens; round robin gives every worker of each role a share; a decode worker killed with
SIGKILL is evicted and the requests after it succeed on the survivor. All KV is free at the
end of each test on every worker still alive."""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass

import pytest
from helpers_procs import ProcessGroup, ServiceProcess, free_port
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import (
    assert_workers_free,
    generate,
    greedy,
    ids_request,
    router_config,
    running_router,
    wait_until,
    worker_flags,
)

from splitserve.request.sampling_params import SamplingParams

PROMPTS = [
    [1, 44, 45, 46, 200, 201, 202],
    [1, 50, 60, 70],
    [1] + list(range(300, 320)),
    [1, 7, 8, 9, 10],
    [1] + list(range(100, 137)),
    [1, 400, 401, 402, 403, 404],
    [1, 11, 12],
    [1] + list(range(60, 90)),
]
MAX_TOKENS = 8
ROUND_ROBIN = {"prefill_policy": "round_robin", "decode_policy": "round_robin"}


@dataclass
class Worker:
    proc: ServiceProcess
    metrics_port: int

    @property
    def address(self) -> str:
        return self.proc.address

    def counter(self, family: str) -> float:
        """Sum over every label set of the counter `family` on the worker's /metrics."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            if f.name == family
            for s in f.samples
            if s.name == family + "_total"
        )


@dataclass
class Topology:
    model: object
    prefill: list[Worker]
    decode: list[Worker]


@pytest.fixture(scope="module")
def topology(tiny_llama, tmp_path_factory):
    with ProcessGroup(tmp_path_factory.mktemp("router_topology")) as procs:
        started = []
        for role in (
            "prefill",
            "decode",
            "prefill",
            "decode",
        ):  # all launched before any is waited on
            port = free_port()
            start = procs.prefill_worker if role == "prefill" else procs.decode_worker
            extra = ["--max-batch-size", "8"] if role == "decode" else []
            started.append(
                (
                    role,
                    Worker(
                        start(
                            tiny_llama,
                            *worker_flags(),
                            *extra,
                            "--metrics-port",
                            str(port),
                            wait=False,
                        ),
                        port,
                    ),
                )
            )
        for _, w in started:
            w.proc.wait_serving()
        yield Topology(
            tiny_llama,
            [w for r, w in started if r == "prefill"],
            [w for r, w in started if r == "decode"],
        )
        for _, w in started:
            if w.proc.alive():
                assert w.proc.stop() == 0, w.proc.log()


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _request(prompt: list[int], i: int):
    return ids_request(prompt, greedy(MAX_TOKENS, ignore_eos=True), request_id=f"topo-{i}")


def _counts(topo: Topology) -> list[float]:
    return [w.counter("splitserve_prefill_requests") for w in topo.prefill] + [
        w.counter("splitserve_decode_requests_finished") for w in topo.decode
    ]


def test_concurrent_requests_equal_the_oracle_and_round_robin_uses_every_worker(topology, oracle):
    cfg = router_config(
        topology.model,
        [w.address for w in topology.prefill],
        [w.address for w in topology.decode],
        routing=ROUND_ROBIN,
    )

    async def body():
        async with running_router(cfg) as (r, stub):
            await wait_until(
                lambda: all(w.healthy for w in r.registry.workers()), 10, "all four workers healthy"
            )
            before = await asyncio.to_thread(_counts, topology)
            results = await asyncio.gather(
                *(generate(stub, _request(p, i)) for i, p in enumerate(PROMPTS))
            )
            await assert_workers_free(
                [w.address for w in topology.prefill], [w.address for w in topology.decode]
            )
            after = await asyncio.to_thread(_counts, topology)
        return results, [a - b for a, b in zip(after, before)]

    results, served = asyncio.run(body())
    for prompt, res in zip(PROMPTS, results):
        assert res.tokens == oracle(prompt, _params()).token_ids
        assert (
            len(res.chunks) >= 2 and len(res.chunks[0].token_ids) == 1
        )  # streamed: the prefill token alone first
    # round robin over two workers per role: each takes half of the 8 requests
    assert served == [4.0, 4.0, 4.0, 4.0], served


def test_killed_decode_worker_is_evicted_and_later_requests_succeed(topology, oracle):
    survivor, doomed = topology.decode
    cfg = router_config(
        topology.model,
        [w.address for w in topology.prefill],
        [w.address for w in topology.decode],
        routing=ROUND_ROBIN,
    )

    async def body():
        async with running_router(cfg) as (r, stub):
            await wait_until(
                lambda: all(w.healthy for w in r.registry.workers()), 10, "all four workers healthy"
            )
            doomed.proc.kill()
            await wait_until(
                lambda: not r.registry.get(doomed.address).healthy, 10, "the killed worker evicted"
            )
            before = await asyncio.to_thread(
                survivor.counter, "splitserve_decode_requests_finished"
            )
            results = await asyncio.gather(
                *(generate(stub, _request(p, i)) for i, p in enumerate(PROMPTS[:4]))
            )
            after = await asyncio.to_thread(survivor.counter, "splitserve_decode_requests_finished")
            evictions = r.metrics.evictions("decode")
            healthy = {w.address: w.healthy for w in r.registry.workers()}
            await assert_workers_free([w.address for w in topology.prefill], [survivor.address])
        return results, after - before, evictions, healthy

    results, served, evictions, healthy = asyncio.run(body())
    for prompt, res in zip(PROMPTS, results):
        assert res.tokens == oracle(prompt, _params()).token_ids
    assert served == 4.0  # every request went to the survivor
    assert sum(evictions.values()) == 1 and set(evictions) <= {"request_unavailable", "refused"}, (
        evictions
    )
    assert healthy == {
        **{w.address: True for w in topology.prefill},
        survivor.address: True,
        doomed.address: False,
    }
