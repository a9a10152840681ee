"""The issue's topology: one router over two prefill and two decode workers, every one a real
process on loopback. Concurrent streamed requests return exactly the single-process greedy
tokens; round robin gives every worker of each role a share; prefix-aware routing sends a
prompt to the prefill worker caching its prefix; a decode worker killed with
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
from splitserve.router.policies import cached_prefix_blocks

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


def test_prefix_aware_sends_a_prompt_to_the_prefill_worker_caching_its_prefix(topology, oracle):
    # The prefix is cached on the worker LATER in address order, where least-loaded's tie-break
    # would never go: only matching the prompt's 16-byte block keys against the worker's
    # GetLoad keys sends it there. A prompt cached nowhere goes to the other one.
    first, holder = sorted(topology.prefill, key=lambda w: w.address)
    decode = [w.address for w in topology.decode if w.proc.alive()]
    cached = [1] + list(range(410, 450))  # 41 tokens: 10 full blocks of 4 (vocabulary: 512)
    fresh = [1] + list(range(450, 490))

    def prefill_counts() -> list[float]:
        return [w.counter("splitserve_prefill_requests") for w in (first, holder)]

    async def body():
        only_holder = router_config(topology.model, [holder.address], decode)
        async with running_router(only_holder) as (_, stub):
            await generate(stub, ids_request(cached, greedy(2), request_id="prefix-seed"))
        both = router_config(topology.model, [first.address, holder.address], decode)
        async with running_router(both) as (r, stub):
            assert r.cfg.routing.prefill_policy == "prefix_aware"  # the default
            await wait_until(
                lambda: all(w.healthy for w in r.registry.workers()), 30, "every worker healthy"
            )
            seen = r.registry.get(holder.address)
            await wait_until(
                lambda: cached_prefix_blocks(seen.view(), cached) == 10, 30, "holder's keys polled"
            )
            counts = [await asyncio.to_thread(prefill_counts)]
            warm = await generate(stub, _request(cached, 100))
            counts.append(await asyncio.to_thread(prefill_counts))
            cold = await generate(stub, _request(fresh, 101))
            counts.append(await asyncio.to_thread(prefill_counts))
            await assert_workers_free([first.address, holder.address], decode)
        return warm, cold, [[a - b for a, b in zip(*pair)] for pair in zip(counts[1:], counts)]

    warm, cold, served = asyncio.run(body())
    assert served == [[0.0, 1.0], [1.0, 0.0]], served  # cached -> holder, then fresh -> first
    assert warm.last.usage.cached_prompt_tokens == 40  # all 10 blocks, on the holder
    assert cold.last.usage.cached_prompt_tokens == 0
    assert warm.tokens == oracle(cached, _params()).token_ids
    assert cold.tokens == oracle(fresh, _params()).token_ids


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
