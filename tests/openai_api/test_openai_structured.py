"""Structured output end to end: a real router, prefill worker and decode worker (the KV hand-
over over UCX; the prefill worker masks token 0, the decode worker rebuilds the matcher from the
constraint carried in DecodeRequest.sampling), the tiny model with random weights, so only the
constraint makes the output parse. Through the official `openai` client (response_format,
structured_outputs, forced tool calls) and gRPC; each test ends with every KV block free."""

from __future__ import annotations

import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai_helpers import MODEL, chat_until_stop
from structured_schemas import MAX_TOKENS, check_instance, features, schemas

from splitserve.protos import generate_pb2

MSGS = [{"role": "user", "content": "Describe a thing as JSON."}]


def _fmt(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }


SCHEMAS = 50  # issue 35: each through gRPC and through the openai client


def _via_openai(client, schema: dict, seed: int, max_tokens: int = MAX_TOKENS) -> str:
    return chat_until_stop(client, MSGS, seed, max_tokens, response_format=_fmt(schema))


def _via_grpc(
    stack, schema: dict, seed: int, max_tokens: int = MAX_TOKENS, handed_over: bool = True
) -> str:
    sp = generate_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed, json_schema=json.dumps(schema)
    )
    chunks = stack.grpc_generate("A thing:", sp)
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_STOP, schema
    if handed_over:  # the decode worker pulled the prompt's KV (it did not recompute it)
        assert chunks[-1].HasField("kv_handover") and not chunks[-1].kv_handover.recomputed
    return "".join(c.text for c in chunks)


def test_fifty_schemas_through_grpc_and_the_openai_client(stack, client):
    """50 generated schemas (seeded), each sampled at temperature 1 through gRPC and through
    the official openai client (response_format json_schema), each one's KV handed from the
    prefill to the decode worker: every output parses and validates."""
    cases = schemas(seed=35, count=SCHEMAS)
    covered = Counter(f for s in cases for f in features(s))
    for feature in ("nested object", "array", "enum", "bounded number", "optional field"):
        assert covered[feature] >= 10, covered
    pulls = _decode_metric(stack, "splitserve_kv_transfer_seconds_count")
    # the two calls of a schema run side by side (batched: half the wall time); two requests'
    # KV (<= 2 x ~45 blocks) always fits the decode pool, so no pull has to fall back
    with ThreadPoolExecutor(2) as pool:
        for i, schema in enumerate(cases):
            via_grpc = pool.submit(_via_grpc, stack, schema, seed=i)
            via_openai = pool.submit(_via_openai, client, schema, seed=i)
            check_instance(json.loads(via_grpc.result()), schema)
            check_instance(json.loads(via_openai.result()), schema)
    # every request of both paths pulled its prompt's KV from the prefill worker
    assert _decode_metric(stack, "splitserve_kv_transfer_seconds_count") == pulls + 2 * SCHEMAS
    stack.assert_free()


def test_json_object_regex_choice_grammar(stack, client):
    out = client.completions.create(
        model=MODEL,
        prompt="JSON:",
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=1,
        extra_body={
            "structured_outputs": {
                "json": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 4}
            }
        },
    )
    assert set(json.loads(out.choices[0].text)) <= {1, 2}
    out = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_completion_tokens=40,
        temperature=1.0,
        seed=2,
        extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{1,6}-[0-9]{2,4}"}},
    )
    assert re.fullmatch(r"[A-Z][a-z]{1,6}-[0-9]{2,4}", out.choices[0].message.content)
    out = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_completion_tokens=20,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe not"]}},
    )
    assert out.choices[0].message.content in ("yes", "no", "maybe not")
    grammar = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'
    out = client.completions.create(
        model=MODEL,
        prompt="Tuple:",
        max_tokens=60,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    text = out.choices[0].text
    assert out.choices[0].finish_reason == "length" or re.fullmatch(r"\(\d{1,2}(,\d{1,2})*\)", text)
    # any JSON object, streamed: no whitespace between tokens by default
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_completion_tokens=MAX_TOKENS,
        temperature=0.0,
        response_format={"type": "json_object"},
        stream=True,
    )
    streamed = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    finish = [c.choices[0].finish_reason for c in streamed if c.choices][-1]
    assert text.startswith("{") and " " not in text.split('"')[0]
    # a random model may stay in an unbounded object until max_tokens ("length"); else it parses
    assert finish == "length" or isinstance(json.loads(text), dict), (finish, text)
    stack.assert_free()


def test_cut_by_max_tokens_ends_with_length(stack, client):
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 30}
    out = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_completion_tokens=6, response_format=_fmt(schema)
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    assert out.choices[0].message.content.startswith("[")
    stack.assert_free()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def test_forced_tool_calls_return_parseable_arguments(stack, client):
    named = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_completion_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=5,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call_named] = choice.message.tool_calls
    assert call_named.type == "function" and call_named.function.name == "get_weather"
    assert call_named.id.startswith("call_")
    check_instance(json.loads(call_named.function.arguments), WEATHER["function"]["parameters"])
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_completion_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
            tools=[WEATHER, TIME],
            tool_choice="required",
        )
        [call] = out.choices[0].message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        check_instance(json.loads(call.function.arguments), tool["function"]["parameters"])
    # streamed: the text is held back, the last chunk carries the whole call
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_completion_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=5,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    last = chunks[-1].choices[0]
    assert last.finish_reason == "tool_calls" and len(chunks) == 2
    [delta] = last.delta.tool_calls
    assert delta.index == 0 and delta.function.name == "get_weather" and delta.id
    assert delta.function.arguments == call_named.function.arguments  # same seed: same call
    # the call and its result go back into the conversation; the next turn is free text
    history = [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [call_named.model_dump()]},
        {"role": "tool", "tool_call_id": call_named.id, "content": '{"temp_c": 21}'},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=history, max_completion_tokens=5, tools=[WEATHER], tool_choice="none"
    )
    assert out.choices[0].message.tool_calls is None and out.usage.completion_tokens <= 5
    stack.assert_free()


def test_invalid_constraints_are_invalid_argument_on_router_and_workers(stack):
    import grpc
    import pytest

    from splitserve.protos import worker_pb2, worker_pb2_grpc

    bad = [
        (generate_pb2.SamplingParams(regex="a("), "sampling.regex"),
        (generate_pb2.SamplingParams(json_schema='{"type": "foo"}'), "sampling.json_schema"),
        (generate_pb2.SamplingParams(json_schema="{not json"), "sampling.json_schema"),
        (generate_pb2.SamplingParams(grammar="start: nope"), "sampling.grammar"),
        (generate_pb2.SamplingParams(json_object=True, json_whitespace=9), "json_whitespace"),
        (generate_pb2.SamplingParams(regex="a", min_tokens=2, max_tokens=4), "min_tokens"),
    ]
    for sp, where in bad:
        with pytest.raises(grpc.RpcError) as info:
            stack.grpc_generate("Hi", sp)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert where in info.value.details(), info.value.details()
    # the workers check at their own trust boundary too, before allocating anything
    sp = generate_pb2.SamplingParams(max_tokens=4, grammar="start: nope")
    with grpc.insecure_channel(stack.prefill) as ch, pytest.raises(grpc.RpcError) as info:
        worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(
            worker_pb2.PrefillRequest(request_id="bad", prompt_token_ids=[1, 2], sampling=sp),
            timeout=30,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown name" in info.value.details(), info.value.details()
    with grpc.insecure_channel(stack.decode) as ch:
        req = worker_pb2.DecodeRequest(
            request_id="bad", prompt_token_ids=[1, 2], first_token_id=3, sampling=sp
        )
        with pytest.raises(grpc.RpcError) as info:
            list(worker_pb2_grpc.DecodeWorkerStub(ch).Decode(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stack.assert_free()


def test_constraints_over_the_limits_are_refused_and_the_service_keeps_serving(stack, client):
    """A schema over 64 KiB, or nested past the JSON parser, is INVALID_ARGUMENT / HTTP 400
    naming the limit (router, before any worker is touched), through gRPC and the openai
    client; then the service still serves a constrained request and every block is free."""
    import grpc
    import openai

    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}
    deep = {"type": "array", "items": {"type": "integer"}}
    for _ in range(130):  # past the grammar engine's nesting bound, within the HTTP front's
        deep = {"type": "array", "items": deep}
    for schema, says in ((big, "send at most 65536"), (deep, "recursion limit exceeded")):
        with pytest.raises(grpc.RpcError) as info:
            stack.grpc_generate("Hi", generate_pb2.SamplingParams(json_schema=json.dumps(schema)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert "sampling.json_schema" in info.value.details(), info.value.details()
        assert says in info.value.details(), info.value.details()
        if schema is deep:  # the HTTP front refuses bodies this deep itself (MAX_JSON_DEPTH)
            continue
        with pytest.raises(openai.BadRequestError) as http_info:
            _via_openai(client, schema, seed=0)
        assert http_info.value.body["param"] == "response_format", http_info.value.body
        assert says in http_info.value.body["message"], http_info.value.body
    deeper = "[" * 20_000 + "]" * 20_000  # past Python's own recursion limit
    with pytest.raises(grpc.RpcError) as info:
        stack.grpc_generate("Hi", generate_pb2.SamplingParams(json_schema=deeper))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nests too deeply" in info.value.details(), info.value.details()
    schema = schemas(seed=39, count=1)[0]
    check_instance(json.loads(_via_openai(client, schema, seed=1)), schema)
    stack.assert_free()


def test_greedy_constrained_equals_the_single_process_engine(stack, oracle):
    """Prefill masks token 0, decode rebuilds the matcher from the hand-over: the tokens are the
    offline engine's (one process, one matcher) exactly."""
    from splitserve.request.constraint import Constraint
    from splitserve.request.sampling_params import SamplingParams

    ids = oracle.tokenizer.encode("A thing:")
    for schema in schemas(seed=36, count=3):
        text = json.dumps(schema)
        ref = oracle(
            ids,
            SamplingParams(
                temperature=0,
                max_tokens=MAX_TOKENS,
                constraint=Constraint(kind="json_schema", text=text),
            ),
        )
        sp = generate_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, json_schema=text)
        chunks = stack.grpc_generate(ids, sp)
        assert [t for c in chunks for t in c.token_ids] == ref.token_ids
        check_instance(json.loads(ref.text), schema)
    stack.assert_free()


def _decode_metric(stack, name: str) -> float:
    from openai_helpers import http

    page = http("GET", f"http://127.0.0.1:{stack.decode_metrics_port}/metrics")[1]
    line = next(x for x in page.splitlines() if x.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("path", ["grpc", "openai"])
def test_constrained_requests_under_decode_preemption(stack, client, path):
    """The 50 generated schemas of a path (gRPC, or the openai client's response_format), ten
    requests in flight at a time, whose outputs outgrow the decode worker's pool (128 blocks of
    4): sequences are preempted and recomputed, and every output still validates."""
    cases = schemas(seed=37 if path == "grpc" else 38, count=SCHEMAS)
    for s in cases:  # long required strings: ~8 x 110 tokens > the pool's 508 slots
        s["properties"]["pad"] = {"type": "string", "minLength": 90, "maxLength": 100}
        s["required"].append("pad")
    before = _decode_metric(stack, "splitserve_decode_preemptions_total")
    masked = _decode_metric(stack, "splitserve_decode_mask_seconds_count")

    def one(i: int) -> str:
        if path == "grpc":  # a pull may find the pool full here: then the prompt is recomputed
            return _via_grpc(stack, cases[i], seed=i, max_tokens=200, handed_over=False)
        return _via_openai(client, cases[i], seed=i, max_tokens=200)

    with ThreadPoolExecutor(10) as pool:
        texts = list(pool.map(one, range(SCHEMAS)))
    assert _decode_metric(stack, "splitserve_decode_preemptions_total") > before
    assert _decode_metric(stack, "splitserve_decode_mask_seconds_count") > masked + 50
    assert _decode_metric(stack, "splitserve_decode_grammar_compile_seconds_count") >= 1
    for text, schema in zip(texts, cases):
        check_instance(json.loads(text), schema)
    stack.assert_free()
