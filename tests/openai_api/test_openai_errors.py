"""Refusals through the official `openai` client: every unsupported or out-of-range parameter
is a 400 in OpenAI's error shape naming it, an unknown model a 404, a body that is not a JSON
object a 400, and the server keeps serving after each (nothing allocated on any worker); the
parameters once refused (logit_bias, min_tokens) are served."""

from __future__ import annotations

import openai
import pytest
from openai_helpers import MAX_MODEL_LEN, MODEL, http, still_serving

MSGS = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}

# (endpoint, arguments, the parameter the 400 must name)
COMPLETIONS = [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(seed=-1), "seed"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(n=2), "n"),
    (dict(best_of=3), "best_of"),
    (dict(echo=True), "echo"),
    (dict(suffix="tail"), "suffix"),
    (dict(logit_bias={"five": 10}), "logit_bias"),
    (dict(logit_bias={"-5": 10}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={"5": 1e39}), "logit_bias"),  # inf as float32
    (dict(logit_bias={"99999": 1}), "logit_bias"),
    (dict(logit_bias={str(t): 1 for t in range(301)}), "logit_bias"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(prompt=["one", "two"]), "prompt"),
    (dict(prompt=[1, 2, 99999]), "prompt"),
    (dict(prompt=[1] * MAX_MODEL_LEN), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(extra_body={"top_k": -2}), "top_k"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"stop_token_ids": [100000]}), "stop_token_ids"),
    (dict(extra_body={"min_tokens": 3}), "min_tokens"),  # max_tokens is 2
    (dict(extra_body={"min_tokens": -1}), "min_tokens"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate"),
    (dict(extra_body={"temperature": "hot"}), "temperature"),
    (dict(extra_body={"structured_outputs": {"json": {"type": "foo"}}}), "structured_outputs"),
]
CHAT = [
    (dict(max_completion_tokens=0), "max_completion_tokens"),
    (dict(max_completion_tokens=5, max_tokens=5), "max_completion_tokens"),
    (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(temperature=1e39), "temperature"),  # inf as float32, the wire type
    (dict(n=3), "n"),
    (dict(logit_bias={"5": -100.5}), "logit_bias"),
    (dict(extra_body={"min_tokens": 3}), "min_tokens"),  # max_completion_tokens is 2
    (dict(max_completion_tokens=None, extra_body={"min_tokens": 10**6}), "min_tokens"),
    # structured output: tool_choice "auto" (the default with tools) has no parser; bad schemas,
    # regexes and grammars are the grammar engine's 400, named after the parameter sent
    (dict(tools=[TOOL]), "tool_choice"),
    (dict(tools=[TOOL], tool_choice="auto"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (
        dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        "tool_choice",
    ),
    (
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "response_format",
    ),
    (dict(response_format=BAD_SCHEMA), "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "a("}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"grammar": "start: foo"}}), "structured_outputs"),
    (
        dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
        "structured_outputs",
    ),
    (dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0]"),  # no tool_call_id
    (dict(messages=[{"role": "user"}]), "messages[0]"),  # content null without tool_calls
    (dict(messages=[{"role": "critic", "content": "x"}]), "messages[0].role"),
    (
        dict(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        "messages[0].content",
    ),
    (dict(messages=[{"role": "user", "content": "Hi" * 300}]), "messages"),
    (dict(extra_body={"guided_json": {"type": "object"}}), "guided_json"),
]
CASES = [("completions", kw, p) for kw, p in COMPLETIONS] + [("chat", kw, p) for kw, p in CHAT]


def _call(client, endpoint: str, kw: dict, **more):
    if endpoint == "chat":
        args = {"model": MODEL, "messages": MSGS, "max_completion_tokens": 2, **kw, **more}
        return client.chat.completions.create(**args)
    return client.completions.create(
        **{"model": MODEL, "prompt": "Hello", "max_tokens": 2, **kw, **more}
    )


@pytest.mark.parametrize(
    ("endpoint", "kw", "param"),
    CASES,
    ids=[f"{e}-{p}-{'-'.join(map(str, kw))}" for e, kw, p in CASES],
)
def test_refused_parameter_is_a_400_naming_it(stack, client, endpoint, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        _call(client, endpoint, kw)
    err = info.value
    assert err.status_code == 400
    assert err.body["param"] == param and param in err.body["message"], err.body
    assert err.body["type"] == "invalid_request_error" and err.body["code"], err.body
    still_serving(client)
    stack.assert_free()  # refused before anything was allocated, on every worker


def test_logit_bias_and_min_tokens_are_served(stack, client, oracle):
    """No longer refused: a +100 bias on one token makes every token that one; EOS biased +100
    ends the request right after min_tokens tokens; the HTTP text equals the offline engine's."""
    from splitserve.request.sampling_params import SamplingParams

    prompt, forced = [1, 44, 45, 46], 77
    eos = oracle.tokenizer.eos_token_id
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=1, logit_bias={str(forced): 100}
    )
    ref = oracle(prompt, SamplingParams(max_tokens=5, logit_bias={forced: 100}))
    assert ref.token_ids == [forced] * 5
    assert out.choices[0].text == ref.text and out.usage.completion_tokens == 5
    out = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_completion_tokens=12,
        seed=3,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 4},
    )
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "stop"
    still_serving(client)
    stack.assert_free()


def test_unknown_model_is_a_404_and_bad_bodies_are_400s(stack, client):
    for call in (
        lambda: client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2),
        lambda: client.chat.completions.create(model="gpt-4o", messages=MSGS, stream=True),
        lambda: client.models.retrieve("gpt-4o"),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert (
            info.value.body["code"] == "model_not_found" and "gpt-4o" in info.value.body["message"]
        )
        still_serving(client)
    # the model may be left out (the served one), and raw bodies that are not JSON objects are 400s
    status, body, _ = stack.post(
        "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    )
    assert status == 200 and body["model"] == MODEL
    for raw in (b"{not json", b"[1, 2]"):
        status, body, _ = http("POST", stack.base_url + "/v1/completions", raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body, _ = stack.get("/v1/nothing-here")
    assert status == 404 and body["error"]["message"]
    still_serving(client)
    stack.assert_free()
