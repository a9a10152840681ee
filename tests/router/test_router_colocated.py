"""Colocated mode (routing.colocated / `router --colocated`): no prefill workers; the router
opens Decode(prompt, sampling) with no kv and no first token on the real decode worker, which
computes the prompt itself. Tokens, text, finish reasons and usage equal the single-process
engine; health is SERVING with one decode worker; prefill workers are refused with one line."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from router_helpers import (
    generate,
    greedy,
    ids_request,
    router_config,
    rpc_error,
    running_router,
    text_request,
    wait_until,
)

from splitserve.cli import router_cmd
from splitserve.config.files import ConfigError
from splitserve.protos import generate_pb2, router_pb2, router_pb2_grpc
from splitserve.request.sampling_params import SamplingParams
from splitserve.router.config import RouterConfig

FINISH = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}


def _params(sp: generate_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p if sp.HasField("top_p") else 1.0,
        seed=sp.seed if sp.HasField("seed") else None,
        max_tokens=sp.max_tokens,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
    )


def test_colocated_generation_equals_offline_engine(cluster, oracle):
    tok = oracle.tokenizer
    ids = [1] + list(range(300, 330))
    first = oracle(ids, SamplingParams(temperature=0, max_tokens=4)).token_ids[0]
    probe = oracle(ids, SamplingParams(temperature=0, max_tokens=20))
    stop = probe.text[6:9].strip() or probe.text[6:9]
    text = "The quick brown fox jumps over"
    cases = [
        (tok.encode(text), text_request(text, greedy(20))),
        (ids, ids_request(ids, greedy(20, stop=[stop]), request_id="stop-str")),
        (
            ids,
            ids_request(
                ids,
                generate_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12),
                request_id="seeded",
            ),
        ),
        (ids, ids_request(ids, greedy(1), request_id="one")),  # the first token ends it (length)
        (ids, ids_request(ids, greedy(8, stop_token_ids=[first]), request_id="stop-first")),
    ]

    async def body():
        cfg = router_config(cluster.model, decode=[cluster.decode], routing={"colocated": True})
        async with running_router(cfg) as (router, stub):
            assert router.ready and not router.registry.healthy(generate_pb2.WORKER_ROLE_PREFILL)
            results = await asyncio.gather(*(generate(stub, req) for _, req in cases))
            ttft = router.metrics.registry.get_sample_value("splitserve_router_ttft_seconds_count")
            await cluster.assert_free()
        return results, ttft

    results, ttft = asyncio.run(body())
    for (prompt, req), res in zip(cases, results):
        ref = oracle(prompt, _params(req.sampling))
        assert res.tokens == ref.token_ids, req.request_id
        assert res.text == ref.text, req.request_id
        assert res.last.finish_reason == FINISH[ref.finish_reason], req.request_id
        assert all(not c.HasField("usage") and not c.finish_reason for c in res.chunks[:-1])
        usage = res.last.usage
        assert (usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens) == (
            len(prompt),
            0,
            len(ref.token_ids),
        )
    assert results[1].last.stop_reason.stop_str == stop
    assert results[4].tokens == [first] and results[4].last.stop_reason.stop_token_id == first
    assert ttft == len(cases)  # observed at each request's first decode chunk


def test_colocated_refuses_prefill_workers_with_one_line(cluster, tiny_llama, capsys):
    with pytest.raises(ConfigError, match="colocated mode sends no prefills"):
        RouterConfig.load(
            None,
            {
                "model_path": str(tiny_llama),
                "routing.colocated": True,
                "workers.prefill": ["127.0.0.1:1"],
            },
        )
    code = router_cmd.main(
        [
            "--model",
            str(tiny_llama),
            "--colocated",
            "--prefill",
            "127.0.0.1:1",
            "--decode",
            "127.0.0.1:2",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert (
        code == 2
        and err.count("\n") == 0
        and "drop the prefill workers or routing.colocated" in err
    )

    async def body():
        cfg = router_config(cluster.model, routing={"colocated": True})
        async with running_router(cfg, ready=False) as (router, _):
            assert not router.ready  # no decode worker yet
            async with grpc.aio.insecure_channel(router.address) as ch:
                ctl = router_pb2_grpc.RouterControlStub(ch)
                refused = await rpc_error(
                    ctl.RegisterWorker(
                        router_pb2.RegisterWorkerRequest(
                            role=generate_pb2.WORKER_ROLE_PREFILL, address=cluster.prefill
                        )
                    )
                )
                await ctl.RegisterWorker(
                    router_pb2.RegisterWorkerRequest(
                        role=generate_pb2.WORKER_ROLE_DECODE, address=cluster.decode
                    )
                )
                await wait_until(lambda: router.ready, 10, "registered decode worker healthy")
        return refused

    refused = asyncio.run(body())
    assert (
        refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "register decode workers only" in refused.details()
    )
