"""Structured output end to end: a real router, prefill worker and decode worker (the KV hand-
over over UCX; the prefill worker masks token 0, the decode worker rebuilds the matcher from the
constraint carried in DecodeRequest.sampling), the tiny model with random weights, so only the
constraint makes the output parse. Through the official `openai` client (response_format,
structured_outputs, forced tool calls) and gRPC; each test ends with every KV block free."""

from __future__ import annotations

import json
import re

from openai_helpers import MODEL
from structured_schemas import MAX_TOKENS, check_instance, schemas

from splitserve.protos import generate_pb2

MSGS = [{"role": "user", "content": "Describe a thing as JSON."}]


def _fmt(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }


def test_json_schemas_through_http_and_grpc(stack, client):
    """Generated schemas, sampled at temperature 1: every output parses and validates."""
    for i, schema in enumerate(schemas(seed=35, count=20)):
        if i % 2:
            out = client.chat.completions.create(
                model=MODEL,
                messages=MSGS,
                max_completion_tokens=MAX_TOKENS,
                temperature=1.0,
                seed=i,
                response_format=_fmt(schema),
            )
            choice = out.choices[0]
            assert choice.finish_reason == "stop", (schema, choice)
            text = choice.message.content
        else:
            sp = generate_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, seed=i, json_schema=json.dumps(schema)
            )
            chunks = stack.grpc_generate("A thing:", sp)
            assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_STOP, schema
            assert chunks[-1].HasField("kv_handover") and not chunks[-1].kv_handover.recomputed
            text = "".join(c.text for c in chunks)
        check_instance(json.loads(text), schema)
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


def test_constrained_requests_under_decode_preemption(stack):
    """Eight concurrent constrained requests whose outputs outgrow the decode worker's pool (128
    blocks of 4): sequences are preempted and recomputed, and every output still validates."""
    from concurrent.futures import ThreadPoolExecutor

    cases = schemas(seed=37, count=8)
    for s in cases:  # long required strings: ~8 x 110 tokens > the pool's 508 slots
        s["properties"]["pad"] = {"type": "string", "minLength": 90, "maxLength": 100}
        s["required"].append("pad")
    before = _decode_metric(stack, "splitserve_decode_preemptions_total")
    masked = _decode_metric(stack, "splitserve_decode_mask_seconds_count")

    def one(i: int) -> str:
        sp = generate_pb2.SamplingParams(
            max_tokens=230, temperature=1.0, seed=i, json_schema=json.dumps(cases[i])
        )
        chunks = stack.grpc_generate("Go:", sp)
        assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
        return "".join(c.text for c in chunks)

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))
    assert _decode_metric(stack, "splitserve_decode_preemptions_total") > before
    assert _decode_metric(stack, "splitserve_decode_mask_seconds_count") > masked + 50
    assert _decode_metric(stack, "splitserve_decode_grammar_compile_seconds_count") >= 1
    for text, schema in zip(texts, cases):
        check_instance(json.loads(text), schema)
    stack.assert_free()
