"""Bad requests get INVALID_ARGUMENT (or ALREADY_EXISTS) with a message saying how to fix them,
before any worker is touched, and the router keeps serving."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from router_helpers import (
    MAX_MODEL_LEN,
    generate,
    greedy,
    ids_request,
    read_rest,
    router_config,
    rpc_error,
    running_router,
    text_request,
)

from splitserve.protos import generate_pb2

INVALID = grpc.StatusCode.INVALID_ARGUMENT
S = generate_pb2.SamplingParams
CASES = {
    "empty text": (text_request("", greedy(4)), "text is empty; send a non-empty prompt"),
    "no prompt": (generate_pb2.GenerateRequest(sampling=greedy(4)), "prompt is not set"),
    "empty token ids": (
        ids_request([], greedy(4)),
        "token_ids.ids is empty; send at least one token",
    ),
    "ids over max_model_len": (
        ids_request([5] * MAX_MODEL_LEN, greedy(4)),
        f"shorten the prompt to at most {MAX_MODEL_LEN - 1} tokens",
    ),
    "text over max_model_len": (text_request("z, " * 300, greedy(4)), "text has"),
    "token id >= vocab": (
        ids_request([1, 2, 512], greedy(4)),
        "token_ids.ids[2] = 512 is outside the model's vocabulary (size 512)",
    ),
    "max_tokens 0": (ids_request([1, 2], S(max_tokens=0)), "max_tokens"),
    "temperature < 0": (ids_request([1, 2], S(temperature=-0.5)), "use a finite value >= 0"),
    "temperature nan": (
        ids_request([1, 2], S(temperature=math.nan)),
        "sampling.temperature is nan",
    ),
    "top_p 0": (ids_request([1, 2], S(top_p=0.0)), "use a value in (0, 1]"),
    "top_p > 1": (ids_request([1, 2], S(top_p=1.5)), "use a value in (0, 1]"),
    "stop token >= vocab": (ids_request([1, 2], S(stop_token_ids=[600])), "use ids below 512"),
    "request id too long": (
        ids_request([1, 2], greedy(2), request_id="x" * 300),
        "at most 256 printable",
    ),
    "oversized message": (
        text_request("a" * 5000, greedy(2)),
        "over this router's limit of 4096 bytes",
    ),
}


@pytest.fixture(scope="module")
def workerless(tiny_llama):
    """A router with no worker at all: whatever gets past validation ends UNAVAILABLE, so an
    INVALID_ARGUMENT here was decided before any worker could have been asked."""
    return router_config(tiny_llama, max_request_bytes=4096, server={"max_message_mb": 1})


def test_every_bad_request_gets_its_status_before_any_worker(workerless):
    async def body():
        async with running_router(workerless, ready=False) as (router, stub):
            got = {name: await rpc_error(generate(stub, req)) for name, (req, _) in CASES.items()}
            valid = await rpc_error(generate(stub, ids_request([1, 2, 3], greedy(2))))
            too_big = await rpc_error(generate(stub, text_request("b" * (2**20 + 10), greedy(2))))
            assert not router.generate.live
        return got, valid, too_big

    got, valid, too_big = asyncio.run(body())
    for name, (_, fragment) in CASES.items():
        assert got[name].code() == INVALID, (name, got[name].code(), got[name].details())
        assert fragment in got[name].details(), (name, got[name].details())
        assert "\n" not in got[name].details()
    assert valid.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy prefill worker" in valid.details() and "--prefill" in valid.details()
    # beyond the server's gRPC message limit, gRPC itself refuses the message
    assert too_big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_duplicate_live_request_id_and_the_router_keeps_serving(cluster, oracle):
    prompt = [1, 44, 45, 46, 200, 201, 202]

    async def body():
        async with running_router(
            router_config(cluster.model, [cluster.prefill], [cluster.decode])
        ) as (_, stub):
            long_call = stub.Generate(
                ids_request(prompt, greedy(200, ignore_eos=True), request_id="dup"), timeout=60
            )
            first = await long_call.read()
            dup = await rpc_error(generate(stub, ids_request(prompt, greedy(2), request_id="dup")))
            bad = [await rpc_error(generate(stub, req)) for req, _ in list(CASES.values())[:4]]
            rest = await read_rest(long_call)
            again = await generate(
                stub, ids_request(prompt, greedy(5), request_id="dup")
            )  # finished: free again
            await cluster.assert_free()
        return first, dup, bad, rest, again

    first, dup, bad, rest, again = asyncio.run(body())
    assert dup.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "'dup' is already in flight" in dup.details() and "unique id" in dup.details()
    assert all(e.code() == INVALID for e in bad)
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 200
    assert rest[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert again.last.request_id == "dup" and len(again.tokens) == 5
