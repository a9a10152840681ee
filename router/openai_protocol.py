"""OpenAI request bodies -> the router's GenerateRequest, and errors in OpenAI's JSON shape.

Only what a GenerateRequest cannot say is checked here: JSON types, unknown parameters, the
features this server does not have (n > 1, best_of > 1, echo, suffix, logit_bias, tools,
response_format other than text, batched prompts), and integers the proto cannot hold
(negative ids, seeds, ...). Every range check (temperature, top_p, penalties, logprobs, max_tokens,
prompt length and vocabulary) is the gRPC path's own (intake.py / service/proto_convert.py);
`error_from_request_error` renames its `sampling.X` / `text` / `token_ids.ids` into the names
the client sent. Every refusal is a 400 naming the parameter, never a silent ignore.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from splitserve.protos import generate_pb2
from splitserve.request.errors import RequestError

_U32 = 2**32 - 1
_U64 = 2**64 - 1

# gRPC status -> HTTP status, OpenAI error type
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


class OpenAIError(Exception):
    """An HTTP error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    @classmethod
    def bad(cls, param: str | None, message: str) -> OpenAIError:
        return cls(400, message, param, "invalid_argument")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def error_from_request_error(
    err: RequestError, names: dict[str, str], prompt_param: str
) -> OpenAIError:
    """A RequestError of the shared path, its status mapped and its field renamed: `names` maps
    proto sampling fields to the OpenAI names the client used; prompt fields become `prompt_param`."""
    status, type_ = _HTTP.get(err.code, (500, "server_error"))
    message, param = err.message, None
    if m := re.match(r"sampling\.(\w+)", message):
        param = names.get(m[1], m[1])
        message = param + message[m.end() :]
    elif m := re.match(r"(text|token_ids\.ids)\b", message):
        param = prompt_param
        message = prompt_param + message[m.end() :]
    elif message.startswith("request_id"):
        param = "X-Request-Id"
        message = "the X-Request-Id header" + message[len("request_id") :]
    return OpenAIError(status, message, param, err.code.name.lower(), type_)


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validates a JSON body; the first problem is a 400 naming its parameter."""
    if not isinstance(body, dict):
        raise OpenAIError.bad(None, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _loc(err["loc"])
        if err["type"] == "extra_forbidden":
            raise OpenAIError.bad(
                param, f"{param}: unknown parameter, not supported by this server; remove it"
            ) from None
        if err["type"] == "missing":
            raise OpenAIError.bad(param, f"{param} is required") from None
        msg = err["msg"].removeprefix("Value error, ")
        last = str(err["loc"][-1]) if err["loc"] else ""
        if (
            err["type"] == "value_error" and last and msg.startswith(last)
        ):  # our own messages name the field
            raise OpenAIError.bad(param, param + msg[len(last) :]) from None
        got = repr(err.get("input"))
        got = f" (got {got})" if len(got) <= 80 else ""
        raise OpenAIError.bad(param, f"{param}: {msg}{got}") from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


def _unsupported(name: str, why: str):
    def check(cls, v):
        if v is not None and not (isinstance(v, (list, dict)) and not v):
            raise ValueError(f"{name} is not supported by this server ({why})")
        return v

    return field_validator(name)(classmethod(check))


class _Common(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, le=_U64)
    stop: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    user: str | None = None  # an end-user id for the client's own bookkeeping; not used
    logit_bias: dict[str, float] | None = None
    # extensions, with vLLM's names
    top_k: int | None = Field(None, ge=-1, le=_U32)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    _no_logit_bias = _unsupported("logit_bias", "no per-token logit bias")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(
                f"n = {v} is not supported: one choice per request; send {v} requests "
                "(with different seeds) instead"
            )
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> str | list[str] | None:
        if (
            v is None
            or isinstance(v, str)
            or (isinstance(v, list) and all(isinstance(x, str) for x in v))
        ):
            return v
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, v: list[int] | None) -> list[int] | None:
        bad = next((t for t in v or () if not 0 <= t <= _U32), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is negative or too large")
        return v

    def _checks(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise OpenAIError.bad(
                "stream_options", "stream_options is only allowed with stream: true"
            )

    def _sampling(
        self, max_tokens: int | None, logprobs: int | None
    ) -> generate_pb2.SamplingParams:
        sp = generate_pb2.SamplingParams(
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
            stop_token_ids=self.stop_token_ids or [],
        )
        for name in (
            "temperature",
            "top_p",
            "seed",
            "repetition_penalty",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
        ):
            if (value := getattr(self, name)) is not None:
                setattr(sp, name, value)
        if max_tokens is not None:
            sp.max_tokens = max_tokens
        if logprobs is not None:
            sp.logprobs = logprobs
        return sp

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Any
    max_tokens: int | None = Field(16, ge=0, le=_U32)  # OpenAI's default; null: up to max_model_len
    logprobs: int | None = Field(None, ge=0, le=_U32)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    _no_suffix = _unsupported("suffix", "no fill-in-the-middle")

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
        bad = next((i for i, t in enumerate(v) if not 0 <= t <= _U32), None)
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
        return {}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: Any) -> str | list[TextPart]:
        if isinstance(v, str):
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

    def as_template_input(self) -> dict[str, str]:
        content = (
            self.content
            if isinstance(self.content, str)
            else "\n".join(p.text for p in self.content)
        )
        msg = {"role": self.role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(
        None, ge=0, le=_U32
    )  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(None, ge=0, le=_U32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=_U32)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    _no_tools = _unsupported("tools", "no tool calling")
    _no_functions = _unsupported("functions", "no function calling")
    _no_function_call = _unsupported("function_call", "no function calling")

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        if v not in (None, "none"):
            raise ValueError(
                "tool_choice is not supported by this server (no tool calling); leave it out or 'none'"
            )
        return v

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError(
                f"response_format type {v.get('type')!r} is not supported (no structured output); "
                'only {"type": "text"}'
            )
        return v

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
        return generate_pb2.GenerateRequest(
            request_id=request_id,
            token_ids=generate_pb2.TokenIds(ids=prompt_ids),
            skip_special_tokens=self.skip_special_tokens,
            sampling=self._sampling(max_tokens, logprobs),
        )

    def names(self) -> dict[str, str]:
        return {
            "max_tokens": "max_tokens" if self.max_tokens is not None else "max_completion_tokens",
            "logprobs": "top_logprobs",
        }
