"""Generation through the router over a real prefill worker and a real decode worker equals
the single-process engine: tokens, text, finish reasons and usage, for concurrent text and
token-id prompts; the first token comes alone, straight from prefill; a request the first
token already ends never reaches the decode worker. Every test ends with all KV free."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from router_helpers import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    generate,
    greedy,
    ids_request,
    router_config,
    running_router,
    text_request,
    wait_until,
    worker_load,
)

from splitserve.protos import generate_pb2
from splitserve.request.sampling_params import SamplingParams
from splitserve.router.policies import cached_prefix_blocks

FINISH = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}
TEXTS = [
    "The quick brown fox jumps over",
    "In the morning the market opened early; farmers brought",
]
ID_PROMPTS = [[1, 44, 45, 46, 200, 201, 202], [1] + list(range(300, 340))]


def _check_against_oracle(result, prompt, params, ref) -> None:
    assert result.tokens == ref.token_ids
    assert result.text == ref.text
    first, last = result.chunks[0], result.last
    assert list(first.token_ids) == ref.token_ids[:1]  # the prefill token, alone
    assert all(not c.HasField("usage") and not c.finish_reason for c in result.chunks[:-1])
    assert last.finish_reason == FINISH[ref.finish_reason]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(prompt),
        len(ref.token_ids),
    )


def test_greedy_generation_equals_offline_engine_for_concurrent_requests(cluster, oracle):
    tok = oracle.tokenizer
    cases = [(tok.encode(t), text_request(t, greedy(n)), n) for t, n in zip(TEXTS, (24, 9))]
    cases += [
        (ids, ids_request(ids, greedy(n), request_id=f"ids-{i}"), n)
        for i, (ids, n) in enumerate(zip(ID_PROMPTS, (17, 30)))
    ]
    # a stop string met mid-stream cuts the text, as offline
    probe = oracle(ID_PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))
    stop = probe.text[6:9].strip() or probe.text[6:9]
    cases.append(
        (ID_PROMPTS[0], ids_request(ID_PROMPTS[0], greedy(20, stop=[stop]), request_id="stop"), 20)
    )
    # seeded sampling is reproducible across the prefill and decode processes
    seeded = generate_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12)
    cases.append((ID_PROMPTS[1], ids_request(ID_PROMPTS[1], seeded, request_id="seeded"), 12))

    async def body():
        async with running_router(
            router_config(cluster.model, [cluster.prefill], [cluster.decode])
        ) as (_, stub):
            results = await asyncio.gather(*(generate(stub, req) for _, req, _ in cases))
            await cluster.assert_free()
        return results

    results = asyncio.run(body())
    for (prompt, req, n), result in zip(cases, results):
        sp = req.sampling
        params = SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            seed=sp.seed if sp.HasField("seed") else None,
            max_tokens=n,
            stop=tuple(sp.stop),
        )
        _check_against_oracle(result, prompt, params, oracle(prompt, params))
        ids = {c.request_id for c in result.chunks}
        assert len(ids) == 1 and (req.request_id in ids or not req.request_id)
        assert ids != {""}
    assert results[-2].last.stop_reason.stop_str == stop


def test_usage_counts_prefix_cache_hits_and_logprobs_follow_tokens(cluster, oracle):
    prompt = [1] + list(range(100, 140))  # 41 tokens: 10 full blocks of 4

    async def body():
        async with running_router(
            router_config(cluster.model, [cluster.prefill], [cluster.decode])
        ) as (r, stub):
            cold = await generate(stub, ids_request(prompt, greedy(6, logprobs=2)))
            # the registry's GetLoad polls bring the worker's cached 16-byte block keys, which
            # the prefix-aware policy matches with the same chained keys over the prompt
            worker = r.registry.get(cluster.prefill)
            await wait_until(
                lambda: cached_prefix_blocks(worker.view(), prompt) == 10, 5, "prefix keys polled"
            )
            assert all(len(k) == 16 for k in worker.prefix_keys) and not worker.keys_warned
            warm = await generate(stub, ids_request(prompt, greedy(6, logprobs=2)))
            await cluster.assert_free()
        return cold, warm

    cold, warm = asyncio.run(body())
    ref = oracle(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=2))
    assert cold.tokens == warm.tokens == ref.token_ids
    assert (
        warm.last.usage.cached_prompt_tokens
        == 10 * BLOCK_SIZE
        > cold.last.usage.cached_prompt_tokens
    )
    lps = [lp for c in warm.chunks for lp in c.logprobs]
    assert [lp.token_id for lp in lps] == ref.token_ids
    assert all(len(lp.top_logprobs) == 2 for lp in lps)
    assert abs(lps[0].logprob - ref.logprobs[0].logprob) < 1e-4


def test_first_token_that_ends_the_request_never_opens_decode(cluster, oracle):
    prompt = [1, 50, 60, 70]
    ref = oracle(prompt, SamplingParams(temperature=0, max_tokens=8))
    first_text = oracle.tokenizer.decode(ref.token_ids[:1])
    assert first_text == "til", "the first token needs whole characters for this test"

    async def body():
        # the pull after the prefill: a streamed hand-over opens Decode with the prefill
        # (tests/faults/test_stream_handover.py covers a first token that ends it there)
        async with running_router(
            router_config(
                cluster.model, [cluster.prefill], [cluster.decode], routing={"kv_streaming": False}
            )
        ) as (r, stub):
            before = await worker_load(cluster.decode, "decode")
            one = await generate(stub, ids_request(prompt, greedy(1)))  # prefill says LENGTH
            # the prefill worker does not check stop strings: the router does, and releases the lease
            by_stop = await generate(stub, ids_request(prompt, greedy(8, stop=[first_text])))
            by_token = await generate(
                stub, ids_request(prompt, greedy(8, stop_token_ids=[ref.token_ids[0]]))
            )
            released = r.metrics.leases_released.labels("request_ended")._value.get()
            await cluster.assert_free()
            after = await worker_load(cluster.decode, "decode")
        return before, after, one, by_stop, by_token, released

    before, after, one, by_stop, by_token, released = asyncio.run(body())
    for res, reason in (
        (one, generate_pb2.FINISH_REASON_LENGTH),
        (by_stop, generate_pb2.FINISH_REASON_STOP),
        (by_token, generate_pb2.FINISH_REASON_STOP),
    ):
        assert len(res.chunks) == 1 and res.tokens == ref.token_ids[:1]
        assert res.last.finish_reason == reason and res.last.usage.completion_tokens == 1
    assert one.text == first_text and by_stop.text == "" and by_token.text == ""
    assert by_stop.last.stop_reason.stop_str == first_text
    assert by_token.last.stop_reason.stop_token_id == ref.token_ids[0]
    assert released >= 1  # the stop-string case held a lease that only the router could give back
    assert before == after  # the decode worker saw none of it (its load snapshot did not move)


def test_server_info_health_reflection_and_metrics(cluster):
    cfg = router_config(
        cluster.model,
        [cluster.prefill],
        [cluster.decode],
        model_name="tiny",
        server={"metrics_port": 0},
    )

    async def body():
        async with running_router(cfg) as (router, stub):
            info = await stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)
            await generate(stub, text_request("hello", greedy(3)))
            async with grpc.aio.insecure_channel(router.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                statuses = [
                    (await health.Check(health_pb2.HealthCheckRequest(service=s))).status
                    for s in ("", "splitserve.v1.GenerateService", "splitserve.v1.RouterControl")
                ]
                refl = reflection_pb2_grpc.ServerReflectionStub(channel)
                answer = [
                    a
                    async for a in refl.ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                    )
                ][0]
            url = f"http://127.0.0.1:{router.server.metrics_port}/metrics"
            page = await asyncio.to_thread(
                lambda: urllib.request.urlopen(url, timeout=5).read().decode()
            )
            await cluster.assert_free()
        return info, statuses, answer, page

    info, statuses, answer, page = asyncio.run(body())
    assert (info.model_name, info.max_model_len, info.vocab_size, info.block_size) == (
        "tiny",
        MAX_MODEL_LEN,
        512,
        BLOCK_SIZE,
    )
    assert {(w.role, w.address, w.healthy) for w in info.workers} == {
        (generate_pb2.WORKER_ROLE_PREFILL, cluster.prefill, True),
        (generate_pb2.WORKER_ROLE_DECODE, cluster.decode, True),
    }
    assert set(statuses) == {health_pb2.HealthCheckResponse.SERVING}
    names = {s.name for s in answer.list_services_response.service}
    assert {
        "splitserve.v1.GenerateService",
        "splitserve.v1.RouterControl",
        "grpc.health.v1.Health",
    } <= names
    for line in (
        "splitserve_router_ttft_seconds_count 1.0",
        "splitserve_router_e2e_seconds_count 1.0",
        'splitserve_router_requests_total{outcome="length"} 1.0',
        "splitserve_router_requests_in_flight 0.0",
        f'splitserve_router_worker_healthy{{address="{cluster.prefill}",role="prefill"}} 1.0',
        "splitserve_router_completion_tokens_total 3.0",
    ):
        assert line in page, line
    assert (
        "splitserve_router_itl_seconds_count 0.0" not in page
    )  # decode chunks came after the first


def test_ttft_components_are_observed_per_request(cluster):
    """The workers report the parts of TTFT (prefill queue and compute on PrefillResponse, KV
    transfer and decode queue on the first DecodeResponse); the router observes each once. (The
    pull after the prefill: a streamed transfer overlaps the prefill, `transfer_streamed`.)"""
    components = ("prefill_queue", "prefill_compute", "transfer", "decode_queue")

    async def body():
        async with running_router(
            router_config(
                cluster.model, [cluster.prefill], [cluster.decode], routing={"kv_streaming": False}
            )
        ) as (r, stub):
            res = await generate(stub, ids_request(ID_PROMPTS[1], greedy(5)))
            await cluster.assert_free()
        reg = r.metrics.registry
        got = {
            c: (
                reg.get_sample_value(
                    "splitserve_router_ttft_component_seconds_count", {"component": c}
                ),
                reg.get_sample_value(
                    "splitserve_router_ttft_component_seconds_sum", {"component": c}
                ),
            )
            for c in components
        }
        return res, got, reg.get_sample_value("splitserve_router_e2e_seconds_sum")

    res, got, e2e = asyncio.run(body())
    assert len(res.tokens) == 5
    for component, (count, total) in got.items():
        assert count == 1.0 and total is not None and total >= 0.0, (component, count, total)
    assert got["prefill_compute"][1] > 0.0  # a real forward pass ran
    assert sum(total for _, total in got.values()) <= e2e
