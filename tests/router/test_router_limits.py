"""Limits before work, through a router in front of real workers, over gRPC and the OpenAI HTTP
front: a max_tokens that does not fit after the prompt (never clamped), prompt text over
max_prompt_bytes (refused before it is tokenized), too many or too long stop strings, and an
HTTP body over max_request_bytes + slack. Each refusal names the limit and how to fix it; the
router keeps serving (the oracle's tokens) and every KV block is free afterwards."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
from router_helpers import (
    MAX_MODEL_LEN,
    generate,
    greedy,
    ids_request,
    router_config,
    rpc_error,
    running_router,
    text_request,
)

from splitserve.protos import generate_pb2
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.tokenizer import Tokenizer
from splitserve.router.http_routes import BODY_SLACK_BYTES

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PROMPT = [1, 44, 45, 46, 200, 201, 202]  # 7 tokens: 249 more fit in max_model_len 256
PROMPT_BYTES = 200  # bytes of prompt text; the tiny tokenizer makes at most a token of a byte
REQUEST_BYTES = 64 * 2**10


def _config(cluster, **kw):
    return router_config(
        cluster.model,
        [cluster.prefill],
        [cluster.decode],
        http={"port": 0},
        max_prompt_bytes=PROMPT_BYTES,
        max_request_bytes=REQUEST_BYTES,
        server={"max_message_mb": 1},
        **kw,
    )


async def _post(router, path: str, body, **kw) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one POST to the router's HTTP front."""
    url = f"{router.http.scheme}://{router.http.address}{path}"
    data = body if not isinstance(body, dict) else json.dumps(body)
    async with aiohttp.ClientSession() as session, session.post(url, data=data, **kw) as resp:
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


async def _still_serving(stub, cluster, oracle) -> None:
    want = oracle(PROMPT, SamplingParams(temperature=0, max_tokens=8)).token_ids
    assert (await generate(stub, ids_request(PROMPT, greedy(8)))).tokens == want
    await cluster.assert_free()


def test_max_tokens_past_max_model_len_is_refused_naming_both_numbers(cluster, oracle):
    async def body():
        async with running_router(_config(cluster)) as (router, stub):
            err = await rpc_error(generate(stub, ids_request(PROMPT, greedy(250))))
            full = await generate(stub, ids_request(PROMPT, greedy(249, ignore_eos=True)))
            unset = generate_pb2.SamplingParams(temperature=0, ignore_eos=True)
            long_prompt = list(range(1, 251))  # 250 tokens: 6 left
            up_to_the_end = await generate(stub, ids_request(long_prompt, unset))
            completion = await _post(
                router, "/v1/completions", {"prompt": PROMPT, "max_tokens": 250}
            )
            chat = await _post(
                router,
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 10**6},
            )
            await _still_serving(stub, cluster, oracle)
            return err, full, up_to_the_end, completion, chat

    err, full, up_to_the_end, completion, chat = asyncio.run(body())
    assert err.code() == INVALID
    assert "max_tokens = 250 does not fit: the prompt has 7 tokens and max_model_len is 256" in (
        err.details()
    )
    assert "leaves 249" in err.details() and "at most 249" in err.details()
    # exactly what fits is served in full; unset means "up to max_model_len"
    assert len(full.tokens) == 249 and full.last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert len(up_to_the_end.tokens) == MAX_MODEL_LEN - 250
    status, doc, _ = completion
    assert status == 400 and doc["error"]["param"] == "max_tokens", doc
    assert "max_tokens = 250 does not fit" in doc["error"]["message"]
    assert "leaves 249" in doc["error"]["message"]
    status, doc, _ = chat
    assert status == 400 and doc["error"]["param"] == "max_completion_tokens", doc
    assert f"max_completion_tokens = {10**6} does not fit" in doc["error"]["message"]


def test_prompt_text_over_max_prompt_bytes_is_refused_before_tokenization(
    cluster, oracle, monkeypatch
):
    tokenized: list[str] = []
    encode = Tokenizer.encode

    def spy(self, text, *args, **kw):
        tokenized.append(text)
        return encode(self, text, *args, **kw)

    monkeypatch.setattr(Tokenizer, "encode", spy)
    over = "é" * 101  # 101 characters, 202 UTF-8 bytes
    within = "é" * 100  # exactly 200 bytes
    messages = [
        {"role": "system", "content": "a" * 110},
        {"role": "user", "content": "b" * 91},  # 201 bytes of content in total
    ]

    async def body():
        async with running_router(_config(cluster)) as (router, stub):
            err = await rpc_error(generate(stub, text_request(over, greedy(2))))
            ok = await generate(stub, text_request(within, greedy(2)))
            completion = await _post(router, "/v1/completions", {"prompt": over, "max_tokens": 2})
            chat = await _post(
                router, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}
            )
            await _still_serving(stub, cluster, oracle)
            return err, ok, completion, chat

    err, ok, completion, chat = asyncio.run(body())
    assert err.code() == INVALID
    assert "text is 202 bytes, over this router's limit of 200 bytes" in err.details()
    assert "(max_prompt_bytes)" in err.details() and "shorter prompt" in err.details()
    assert len(ok.tokens) == 2 and within in tokenized
    assert not any(over in t or "a" * 110 in t for t in tokenized)  # never tokenized
    status, doc, _ = completion
    assert status == 400 and doc["error"]["param"] == "prompt", doc
    assert doc["error"]["message"].startswith("prompt is 202 bytes")
    status, doc, _ = chat
    assert status == 400 and doc["error"]["param"] == "messages", doc
    assert "messages hold 201 bytes of content" in doc["error"]["message"]
    assert "max_prompt_bytes" in doc["error"]["message"]


def test_stop_strings_are_bounded_in_number_and_length(cluster, oracle):
    at_limits = [f"{i:02d}" + "~" * 254 for i in range(16)]  # 16 strings of 256 characters

    async def body():
        async with running_router(_config(cluster)) as (router, stub):
            many = await rpc_error(generate(stub, ids_request(PROMPT, greedy(4, stop=["x"] * 17))))
            long = await rpc_error(
                generate(stub, ids_request(PROMPT, greedy(4, stop=["ok", "y" * 257])))
            )
            fits = await generate(stub, ids_request(PROMPT, greedy(4, stop=at_limits)))
            http = await _post(
                router, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stop": ["z"] * 17}
            )
            await _still_serving(stub, cluster, oracle)
        # the limits are the router's to set (up to the workers' 64 of 1024)
        async with running_router(_config(cluster, max_stop_strings=2)) as (_, stub):
            lowered = await rpc_error(
                generate(stub, ids_request(PROMPT, greedy(4, stop=["a"] * 3)))
            )
            await cluster.assert_free()
        return many, long, fits, http, lowered

    many, long, fits, http, lowered = asyncio.run(body())
    assert many.code() == INVALID
    assert "sampling.stop has 17 strings, over this server's limit of 16 (max_stop_strings)" in (
        many.details()
    )
    assert long.code() == INVALID
    assert "sampling.stop[1] is 257 characters long" in long.details()
    assert "limit of 256 (max_stop_string_chars)" in long.details()
    want = oracle(PROMPT, SamplingParams(temperature=0, max_tokens=4, stop=at_limits))
    assert fits.tokens == want.token_ids and fits.text == want.text
    status, doc, _ = http
    assert status == 400 and doc["error"]["param"] == "stop", doc
    assert doc["error"]["message"].startswith("stop has 17 strings")
    assert lowered.code() == INVALID and "limit of 2 (max_stop_strings)" in lowered.details()


def test_http_body_over_max_request_bytes_plus_slack_is_413(cluster, oracle):
    limit = REQUEST_BYTES + BODY_SLACK_BYTES
    big = {"prompt": "x" * limit, "max_tokens": 2}

    async def chunked():  # no Content-Length: refused while it is read
        for _ in range(limit // 8192 + 2):
            yield b"x" * 8192

    async def body():
        async with running_router(_config(cluster)) as (router, stub):
            sized = await _post(router, "/v1/completions", big)
            streamed = await _post(router, "/v1/completions", chunked())
            # within the body limit but over max_request_bytes: the gRPC path's own 400
            over_request = await _post(
                router, "/v1/completions", {"prompt": "x" * (REQUEST_BYTES + 10), "max_tokens": 2}
            )
            await _still_serving(stub, cluster, oracle)
            return sized, streamed, over_request

    sized, streamed, over_request = asyncio.run(body())
    for status, doc, _ in (sized, streamed):
        assert status == 413, doc
        assert doc["error"]["code"] == "request_too_large"
        assert f"over this server's limit of {limit} bytes" in doc["error"]["message"]
        assert "max_request_bytes" in doc["error"]["message"]
    status, doc, _ = over_request
    assert status == 400 and "max_request_bytes" in doc["error"]["message"], doc
