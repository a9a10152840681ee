"""What the openai SDK and its users send back, and what a forced tool call can meet, without a
process: an assistant reply appended to the next request as the SDK builds it, malformed tools
and tool_choice as 400s, stop beside a forced call refused, a call cut short kept as content,
completions' top_logprobs with the sampled token, response_format without a type."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from splitserve.protos import generate_pb2
from splitserve.request.tokenizer import Tokenizer
from splitserve.router.openai_errors import OpenAIError
from splitserve.router.openai_protocol import ChatCompletionRequest
from splitserve.router.openai_response import ResponseBuilder
from splitserve.router.openai_structured import as_tool_call, as_tool_call_delta

USER = {"role": "user", "content": "hi"}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


def _chat(**body) -> ChatCompletionRequest:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], **body})
    req.check_tools()
    return req


def test_an_assistant_reply_goes_back_as_the_sdk_dumps_it():
    # ChatCompletionMessage.model_dump() of our replies, and a streamed call rebuilt by a client
    reply = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": "{}"},
            }
        ],
    }
    tool_turn = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [USER, reply, tool_turn, USER]}
    )
    assert req.messages[1].as_template_input()["tool_calls"][0]["function"]["name"] == "get_weather"
    for field, value in (("audio", {"id": "a"}), ("function_call", {"name": "f"})):
        with pytest.raises(ValidationError, match=f"{field} is not supported"):
            ChatCompletionRequest.model_validate(
                {"model": "m", "messages": [USER, {**reply, field: value}]}
            )


@pytest.mark.parametrize(
    ("tools", "choice"),
    [
        ([1], "required"),
        (["get_weather"], "required"),
        ([TOOL], {"type": "function", "function": "get_weather"}),
        ([TOOL], {"function": {"name": "get_weather"}}),
        ([TOOL], "get_weather"),
        ([TOOL], 3),
        ([TOOL], {"type": "function", "function": {"name": ["get_weather"]}}),
        ([TOOL], {"type": "function", "function": {"name": {"n": 1}}}),
    ],
)
def test_malformed_tools_and_tool_choice_are_400s(tools, choice):
    with pytest.raises(OpenAIError) as info:
        _chat(tools=tools, tool_choice=choice)
    assert info.value.status == 400 and info.value.param in ("tools[0]", "tool_choice")


@pytest.mark.parametrize(("field", "value"), [("stop", ["city"]), ("stop_token_ids", [5])])
def test_stop_beside_a_forced_tool_call_is_refused(field, value):
    req = _chat(tools=[TOOL], tool_choice="required", **{field: value})
    with pytest.raises(OpenAIError, match=f"cannot take {field}") as info:
        req.to_generate("r", [1, 2, 3])
    assert info.value.param == field
    _chat(tools=[TOOL], tool_choice="required").to_generate("r", [1, 2, 3])  # alone: fine


def test_a_call_that_is_not_whole_json_stays_content():
    cut = {"choices": [{"message": {"content": '{"'}, "finish_reason": "stop"}]}
    assert as_tool_call(json.loads(json.dumps(cut)), "get_weather") == cut
    named = {"choices": [{"message": {"content": '{"name": "f"}'}, "finish_reason": "stop"}]}
    assert as_tool_call(json.loads(json.dumps(named)), "") == named  # no arguments
    delta = {"choices": [{"delta": {"content": "{"}, "finish_reason": "stop"}]}
    assert as_tool_call_delta(json.loads(json.dumps(delta)), "f") == delta
    whole = {"choices": [{"message": {"content": '{"a": 1}'}, "finish_reason": "stop"}]}
    call = as_tool_call(whole, "f")["choices"][0]
    assert call["finish_reason"] == "tool_calls"
    assert call["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_completions_top_logprobs_always_hold_the_sampled_token(tiny_llama):
    tok = Tokenizer.from_dir(tiny_llama)
    sampled, others = 70, (71, 72)
    lp = generate_pb2.TokenLogprob(token_id=sampled, logprob=-3.0)
    for t, v in zip(others, (-0.5, -1.0)):
        lp.top_logprobs.add(token_id=t, logprob=v)
    builder = ResponseBuilder("completion", "r", "m", tok, want_logprobs=True)
    top = builder._logprobs([lp])["top_logprobs"][0]
    text = tok.token_bytes(sampled).decode(errors="replace")
    assert top[text] == -3.0 and len(top) == 3  # N + 1: the sampled one was not in the top N


def test_response_format_needs_a_type():
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [USER], "response_format": {}}
    )
    with pytest.raises(OpenAIError, match="needs a type") as info:
        req.to_generate("r", [1, 2])
    assert info.value.param == "response_format"


def test_platform_fields_that_change_no_token_are_taken():
    _chat(store=False, metadata={"team": "a"}, service_tier="auto").to_generate("r", [1, 2])
    for body, message in (
        ({"store": True}, "keeps no completions"),
        ({"service_tier": "flex"}, "not offered"),
        ({"metadata": {str(i): "x" for i in range(17)}}, "metadata"),
        ({"n": 0}, "n = 0 is not supported: one choice per request"),
    ):
        with pytest.raises(ValidationError, match=message):
            _chat(**body)
