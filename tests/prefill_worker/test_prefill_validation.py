"""Bad requests get INVALID_ARGUMENT with a message that names the field and the fix, before
any block is allocated, and the worker keeps serving."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from prefill_helpers import prefill_request, release, serving, worker_config

from splitserve.protos import generate_pb2, worker_pb2
from splitserve.request.errors import RequestError
from splitserve.request.tokenizer import Tokenizer
from splitserve.service.proto_convert import (
    finish_reason_to_proto,
    sampling_params_from_proto,
    stop_reason_to_proto,
    validate_prompt,
)

SP = generate_pb2.SamplingParams
MAX_LEN = 64  # the worker below runs with max_model_len 64; the tiny vocab is 512

BAD = [
    ("empty prompt", [], SP(), "prompt_token_ids is empty"),
    (
        "id past vocab",
        [1, 2, 512],
        SP(),
        "prompt_token_ids[2] = 512 is outside the model's vocabulary (size 512)",
    ),
    ("prompt too long", list(range(1, 65)), SP(), "shorten the prompt to at most 63 tokens"),
    ("max_tokens 0", [1, 2], SP(max_tokens=0), "sampling.max_tokens"),
    ("nan temperature", [1, 2], SP(temperature=math.nan), "sampling.temperature is nan"),
    ("negative temperature", [1, 2], SP(temperature=-0.5), "sampling.temperature"),
    ("top_p 0", [1, 2], SP(top_p=0.0), "use a value in (0, 1]"),
    ("top_p above 1", [1, 2], SP(top_p=1.5), "sampling.top_p"),
    ("stop token past vocab", [1, 2], SP(stop_token_ids=[600]), "stop_token_ids [600] are outside"),
    ("too many logprobs", [1, 2], SP(logprobs=50), "sampling.logprobs"),
    (
        "min_tokens above max_tokens",
        [1, 2],
        SP(max_tokens=2, min_tokens=3),
        "sampling.min_tokens = 3 is more than the 2 tokens",
    ),
    (
        "logit_bias id past vocab",
        [1, 2],
        SP(logit_bias={512: 1.0}),
        "sampling.logit_bias names token ids [512] outside the model's vocabulary (size 512)",
    ),
    (
        "logit_bias 101",
        [1, 2],
        SP(logit_bias={5: 101.0}),
        "sampling.logit_bias[5] = 101 is outside [-100, 100]",
    ),
    ("logit_bias nan", [1, 2], SP(logit_bias={5: math.nan}), "sampling.logit_bias[5] is nan"),
    (  # refused at the worker too, never clamped: 3 + 62 > 64
        "max_tokens past max_model_len",
        [1, 2, 3],
        SP(max_tokens=MAX_LEN - 2),
        "sampling.max_tokens = 62 does not fit: the prompt has 3 tokens and max_model_len is 64, "
        "which leaves 61",
    ),
    (
        "65 stop strings",
        [1, 2],
        SP(stop=["s"] * 65),
        "has 65 strings, over this server's limit of 64",
    ),
    ("long stop string", [1, 2], SP(stop=["x" * 1025]), "stop[0] is 1025 characters long"),
]


def test_bad_requests_are_invalid_argument_and_worker_keeps_serving(tiny_llama):
    cfg = worker_config(tiny_llama, max_model_len=MAX_LEN)

    async def body():
        async with serving(cfg) as (worker, stub):
            for name, prompt, sampling, needle in BAD:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Prefill(prefill_request(f"bad-{name}", prompt, sampling))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert needle in err.value.details(), (name, err.value.details())
            for req in (
                worker_pb2.PrefillRequest(prompt_token_ids=[1, 2]),  # no request_id
                prefill_request("ttl", [1, 2], lease_ttl_ms=10**9),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Prefill(req)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert worker.engine.allocator.num_free == worker.engine.allocator.num_usable
            assert (
                worker.metrics.registry.get_sample_value(
                    "splitserve_prefill_requests_total", {"outcome": "invalid_argument"}
                )
                == len(BAD) + 2
            )
            # the longest allowed prompt still works, without sampling params at all
            good = await stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id="good", prompt_token_ids=list(range(1, MAX_LEN))
                )
            )
            # max_model_len reached by the first token: finishes with "length", no lease
            assert good.finish_reason == generate_pb2.FINISH_REASON_LENGTH and not good.HasField(
                "kv"
            )
            await release(stub, await stub.Prefill(prefill_request("good2", [1, 2, 3])))
            # a max_tokens that fills max_model_len exactly is taken
            fits = SP(max_tokens=MAX_LEN - 3, temperature=0, ignore_eos=True)
            await release(stub, await stub.Prefill(prefill_request("fits", [1, 2, 3], fits)))
            # min_tokens and logit_bias are served: EOS forced by its bias, but banned until
            # min_tokens tokens were generated, so the first token is EOS only with min_tokens 0
            eos = Tokenizer.from_dir(tiny_llama).eos_token_id
            for min_tokens in (0, 1):
                sp = SP(max_tokens=4, min_tokens=min_tokens, logit_bias={eos: 100.0})
                got = await stub.Prefill(prefill_request(f"min{min_tokens}", [1, 2, 3], sp))
                if min_tokens == 0:
                    assert got.first_token_id == eos, got
                    assert got.finish_reason == generate_pb2.FINISH_REASON_STOP, got
                else:
                    assert got.first_token_id != eos and got.HasField("kv"), got
                    await release(stub, got)

    asyncio.run(body())


def test_sampling_conversion_defaults_and_messages():
    p = sampling_params_from_proto(None, prompt_len=10, max_model_len=100, vocab_size=512)
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.logprobs) == (90, 1.0, 1.0, None, None)
    p = sampling_params_from_proto(
        SP(
            max_tokens=5,
            temperature=0,
            seed=0,
            logprobs=0,
            stop=["x"],
            stop_token_ids=[3],
            ignore_eos=True,
        ),
        prompt_len=10,
        max_model_len=100,
        vocab_size=512,
    )
    assert (
        p.max_tokens,
        p.temperature,
        p.seed,
        p.logprobs,
        p.stop,
        p.stop_token_ids,
        p.ignore_eos,
    ) == (5, 0.0, 0, 0, ("x",), (3,), True)
    with pytest.raises(RequestError) as err:
        sampling_params_from_proto(
            SP(stop=["ok", ""]), prompt_len=1, max_model_len=10, vocab_size=10
        )
    assert (
        err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        and "sampling.stop.1" in err.value.message
    )
    with pytest.raises(RequestError, match="outside the model's vocabulary"):
        validate_prompt([1, -1], 10, 10)
    assert finish_reason_to_proto("length") == generate_pb2.FINISH_REASON_LENGTH
    assert finish_reason_to_proto(None) == generate_pb2.FINISH_REASON_UNSPECIFIED
    assert (
        stop_reason_to_proto("###").stop_str == "###" and stop_reason_to_proto(7).stop_token_id == 7
    )
    assert stop_reason_to_proto(None) is None


def test_min_tokens_and_logit_bias_conversion():
    p = sampling_params_from_proto(
        SP(max_tokens=5, min_tokens=5, logit_bias={9: -100.0, 3: 2.5}),
        prompt_len=1,
        max_model_len=100,
        vocab_size=512,
    )
    assert (p.min_tokens, p.logit_bias) == (5, ((3, 2.5), (9, -100.0)))
    cases = [
        (SP(min_tokens=99), "sampling.min_tokens = 99 is more than the 90 tokens"),
        (SP(logit_bias={5: -100.5}), "sampling.logit_bias[5] = -100.5 is outside [-100, 100]"),
        (SP(logit_bias={5: math.inf}), "sampling.logit_bias[5] is inf"),
        (SP(logit_bias=dict.fromkeys(range(301), 1.0)), "has 301 entries; send at most 300"),
    ]
    for msg, needle in cases:
        with pytest.raises(RequestError) as err:
            sampling_params_from_proto(msg, prompt_len=10, max_model_len=100, vocab_size=512)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.message, err.value.message


def test_a_huge_refused_value_is_not_echoed_whole():
    # 100k stop ids: the status must stay deliverable (gRPC caps its metadata) and say the limit
    for ids, limit in (
        ([1] * 100_000, "at most 64"),
        ([10**6 + i for i in range(50)], "below 512"),
    ):
        msg = generate_pb2.SamplingParams(stop_token_ids=ids)
        with pytest.raises(RequestError) as info:
            sampling_params_from_proto(msg, prompt_len=10, max_model_len=100, vocab_size=512)
        assert limit in str(info.value) and len(str(info.value)) < 400, str(info.value)[:500]
