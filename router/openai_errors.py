"""Errors in OpenAI's JSON shape: {"error": {message, type, param, code}} with an HTTP status.

`OpenAIError` is what the HTTP front answers; `error_from_request_error` maps a RequestError of
the shared gRPC path (intake.py, the workers) to its HTTP status and renames its `sampling.X` /
`text` / `token_ids.ids` into the names the client sent; `parse` validates a JSON body against
a request model (openai_protocol.py) and turns its first problem into a 400 naming the parameter.
"""

from __future__ import annotations

import math
import re
from typing import Any

import grpc
from pydantic import BaseModel, ValidationError

from splitserve.request.errors import RequestError

# gRPC status -> HTTP status, OpenAI error type
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error"),
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
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str] | None:
        """`Retry-After` (whole seconds, at least 1) when retrying later can succeed."""
        if self.retry_after_s is None:
            return None
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

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
    code = (
        "invalid_api_key" if err.code == grpc.StatusCode.UNAUTHENTICATED else err.code.name.lower()
    )
    return OpenAIError(status, message, param, code, type_, err.retry_after_s)


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
