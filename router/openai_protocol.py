"""The OpenAI request bodies (completions, chat completions) -> the router's GenerateRequest.

Only what a GenerateRequest cannot say is checked here: JSON types, unknown parameters, the
features this server does not have (n > 1, best_of > 1, echo, suffix, tool_choice "auto",
batched prompts); tool turns (assistant tool_calls, role "tool") are taken, and integers the proto cannot hold
(negative ids, seeds, logit_bias keys, ...). Every range check (temperature, top_p, penalties,
logprobs, max_tokens, min_tokens, logit_bias, prompt length and vocabulary) is the gRPC path's
own (intake.py / service/proto_convert.py); `error_from_request_error` (openai_errors.py)
renames its `sampling.X` / `text` / `token_ids.ids` into the names the client sent. Every
refusal is a 400 naming the parameter, never a silent ignore. The fields both endpoints take
are CommonParams (openai_params.py).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from splitserve.protos import generate_pb2
from splitserve.router.openai_errors import OpenAIError
from splitserve.router.openai_params import U32, CommonParams, StrictModel, unsupported
from splitserve.router.openai_structured import tool_constraint


class CompletionRequest(CommonParams):
    prompt: Any
    max_tokens: int | None = Field(16, ge=0, le=U32)  # OpenAI's default; null: up to max_model_len
    logprobs: int | None = Field(None, ge=0, le=U32)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    _no_suffix = unsupported("suffix", "no fill-in-the-middle")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError(
                "echo is not supported by this server (no prompt logprobs); leave it false"
            )
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"best_of = {v} is not supported: one candidate per request")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # a batch of one
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(t, (str, list)) for t in v):
            raise ValueError(
                f"a batch of {len(v)} prompts is not supported; send one request per prompt"
            )
        if not isinstance(v, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in v
        ):
            raise ValueError("must be a string or a list of token ids")
        bad = next((i for i, t in enumerate(v) if not 0 <= t <= U32), None)
        if bad is not None:
            raise ValueError(f"prompt[{bad}] = {v[bad]} is not a token id")
        return v

    def to_generate(self, request_id: str) -> generate_pb2.GenerateRequest:
        self._checks()
        req = generate_pb2.GenerateRequest(
            request_id=request_id,
            skip_special_tokens=self.skip_special_tokens,
            sampling=self._sampling(self.max_tokens, self.logprobs),
        )
        if isinstance(self.prompt, str):
            req.text = self.prompt
        else:
            req.token_ids.ids.extend(self.prompt)
        return req

    def names(self) -> dict[str, str]:
        return self.constraint_names()


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class CalledFunction(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    """A call an earlier assistant turn made (a forced tool call's answer, sent back)."""

    id: str
    type: Literal["function"]
    function: CalledFunction
    index: int | None = None  # a streamed call as clients rebuild it: the position, unused


def _only_null(name: str, instead: str):
    """Response fields the openai SDK echoes back when a reply goes into the next request:
    taken when null (as our replies send them), refused with a hint otherwise."""

    def check(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError(f"{name} is not supported by this server; {instead}")
        return v

    return field_validator(name)(classmethod(check))


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # None only for an assistant turn that made tool calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this is the result of
    # what our replies carry and the SDK sends back with the next turn (msgs.append(message)):
    # a refusal's text and citations are the model's output, not instructions: not rendered
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None

    _no_audio = _only_null("audio", "send the transcript as text content")
    _no_function_call = _only_null(
        "function_call", "the deprecated functions API is not supported: use tool_calls"
    )

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: Any) -> str | list[TextPart] | None:
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("content must be a string or a list of text parts")
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(
                    f"content parts of type {kind!r} are not supported; this model takes text"
                )
        return [TextPart.model_validate(p) for p in v]

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only with an assistant's tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id is required on tool messages, and only there")
        return self

    def as_template_input(self) -> dict[str, Any]:
        if self.content is None or isinstance(self.content, str):
            # None stays None: the renderer drops None-valued keys as transformers does, so a
            # template's `content is defined` reads a tool-call turn as transformers renders it
            content = self.content
        else:
            content = "\n".join(p.text for p in self.content)
        msg: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:  # arguments as objects, as the chat templates we know expect them
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": _function(c.function)}
                for c in self.tool_calls
            ]
        return msg


def _function(f: CalledFunction) -> dict[str, Any]:
    try:
        return {"name": f.name, "arguments": json.loads(f.arguments)}
    except json.JSONDecodeError:
        return {"name": f.name, "arguments": f.arguments}


class ChatCompletionRequest(CommonParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(
        None, ge=0, le=U32
    )  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(None, ge=0, le=U32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=U32)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    _tool_sampling: generate_pb2.SamplingParams | None = PrivateAttr(None)
    _forced_tool: str | None = PrivateAttr(None)  # check_tools: the call to force, "" any

    _no_functions = unsupported("functions", "deprecated by OpenAI; use tools")
    _no_function_call = unsupported("function_call", "deprecated by OpenAI; use tool_choice")

    def to_generate(self, request_id: str, prompt_ids: list[int]) -> generate_pb2.GenerateRequest:
        self._checks()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise OpenAIError.bad(
                "max_completion_tokens", "give max_completion_tokens or max_tokens, not both"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError.bad("top_logprobs", "top_logprobs needs logprobs: true")
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        sampling = self._sampling(max_tokens, logprobs)
        if self.forced_tool is not None:
            if sampling.WhichOneof("constraint") is not None:
                raise OpenAIError.bad(
                    "tool_choice", "a forced tool call cannot take response_format too"
                )
            for name, given in (
                ("stop", sampling.stop),
                ("stop_token_ids", sampling.stop_token_ids),
            ):
                if given:  # a stop would cut the call's JSON short: arguments no client can parse
                    raise OpenAIError.bad(
                        name, f"a forced tool call (tool_choice) cannot take {name}; drop it"
                    )
            sampling.MergeFrom(self._tool_sampling)
        return generate_pb2.GenerateRequest(
            request_id=request_id,
            token_ids=generate_pb2.TokenIds(ids=prompt_ids),
            skip_special_tokens=self.skip_special_tokens,
            sampling=sampling,
        )

    def check_tools(self) -> None:
        """Refuses what cannot be served before the template renders (tool_choice "auto");
        sets `forced_tool` (None: no call)."""
        self._tool_sampling = generate_pb2.SamplingParams()
        self._forced_tool = tool_constraint(self.tools, self.tool_choice, self._tool_sampling)

    @property
    def forced_tool(self) -> str | None:
        return self._forced_tool

    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools or None

    def names(self) -> dict[str, str]:
        return {
            "max_tokens": "max_tokens" if self.max_tokens is not None else "max_completion_tokens",
            "logprobs": "top_logprobs",
            **self.constraint_names(),
            **({"json_schema": "tools"} if self._forced_tool is not None else {}),
        }
