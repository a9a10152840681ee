"""Structured output over the OpenAI API: `response_format`, vLLM's `structured_outputs`, and
forced tool calls, each turned into the one constraint of generate.proto's SamplingParams.

    response_format {"type": "json_object"}                      -> json_object
    response_format {"type": "json_schema", "json_schema": {...}} -> json_schema (enforced
                                                                     whether `strict` or not)
    structured_outputs {json | regex | choice | grammar | json_object}   (vLLM's names, one)
    structured_outputs {"json_whitespace": n}                    -> at most n free spaces /
                                                                     newlines between JSON tokens
                                                                     (0 by default; beside a JSON
                                                                     constraint given either way)
    tool_choice {"type": "function", "function": {"name": f}}    -> json_schema: f's parameters
    tool_choice "required"                                       -> json_schema: {"name": one of
                                                                     the tools, "arguments": its
                                                                     parameters}

A forced tool call's output comes back as `message.tool_calls` (one call; `content` null);
streamed, the text is held back and the last chunk carries the whole call (http_sinks.py).
`tool_choice: "auto"` (OpenAI's default when tools are given) needs a per-model parser of
free-form tool calls, which this server does not have: a 400 saying what to send instead.
Schema validity is the grammar engine's to judge (intake.py): this module checks shapes only.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from splitserve.protos import generate_pb2
from splitserve.request.constraint import MAX_JSON_WHITESPACE
from splitserve.router.openai_errors import OpenAIError

MAX_TOOLS = 64


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its older `guided_*` fields are not taken)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=False)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    json_whitespace: int | None = Field(None, ge=0, le=MAX_JSON_WHITESPACE)

    def constraints(self) -> list[str]:
        """The constraint fields given (json_whitespace only modifies a JSON one)."""
        dumped = self.model_dump(by_alias=True, exclude={"json_whitespace"})
        return [k for k, v in dumped.items() if v not in (None, False)]


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, (dict, bool)):
        raise OpenAIError.bad(param, f"{param} must be a JSON schema (an object)")
    return json.dumps(schema)


def response_format_constraint(rf: dict[str, Any] | None, sp: generate_pb2.SamplingParams) -> None:
    if rf is None:
        return
    kind = rf.get("type")
    if kind is None:
        raise OpenAIError.bad(
            "response_format", "response_format needs a type: text, json_object or json_schema"
        )
    if kind == "text":
        return
    if kind == "json_object":
        sp.json_object = True
    elif kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise OpenAIError.bad(
                "response_format",
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
            )
        sp.json_schema = _schema_text(spec["schema"], "response_format.json_schema.schema")
    else:
        raise OpenAIError.bad(
            "response_format",
            f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
        )


def structured_outputs_constraint(
    so: StructuredOutputs | None, sp: generate_pb2.SamplingParams
) -> None:
    if so is None:
        return
    if so.json_whitespace is not None:
        sp.json_whitespace = so.json_whitespace  # the server refuses it beside no JSON constraint
    given = so.constraints()
    if not given and so.json_whitespace is not None:
        return  # the constraint comes from response_format
    if len(given) != 1:
        raise OpenAIError.bad(
            "structured_outputs",
            f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
            f"got {given or 'none'}",
        )
    if so.json_ is not None:
        sp.json_schema = _schema_text(so.json_, "structured_outputs.json")
    elif so.regex is not None:
        sp.regex = so.regex
    elif so.choice is not None:
        sp.choice.SetInParent()  # set even when empty: the server then says it is empty
        sp.choice.choices.extend(so.choice)
    elif so.grammar is not None:
        sp.grammar = so.grammar
    else:
        sp.json_object = True


def _functions(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """name -> the parameters schema of each function tool."""
    if len(tools) > MAX_TOOLS:
        raise OpenAIError.bad("tools", f"{len(tools)} tools; send at most {MAX_TOOLS}")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            raise OpenAIError.bad(f"tools[{i}]", f"tools[{i}] must be a function tool")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise OpenAIError.bad(f"tools[{i}]", f"tools[{i}].function.name is required")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise OpenAIError.bad(
                f"tools[{i}]", f"tools[{i}].function.parameters must be an object"
            )
        out[name] = params or {"type": "object", "properties": {}}
    return out


def tool_constraint(
    tools: list[Any] | None, choice: Any, sp: generate_pb2.SamplingParams
) -> str | None:
    """Constrains `sp` for a forced tool call; returns the forced function's name ("" for
    "required": the output names it), or None when no tool is called."""
    if not tools:
        if choice not in (None, "none"):
            raise OpenAIError.bad("tool_choice", "tool_choice needs tools; send them, or drop it")
        return None
    fns = _functions(tools)
    if choice == "none":
        return None
    if choice in (None, "auto"):
        raise OpenAIError.bad(
            "tool_choice",
            'tool_choice "auto" (the default with tools) is not supported: this server has no '
            'parser of free-form tool calls; set tool_choice to "required", name a function '
            '({"type": "function", "function": {"name": ...}}), or "none"',
        )
    if choice == "required":
        sp.json_schema = json.dumps(
            {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": name}, "arguments": params},
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                    for name, params in fns.items()
                ]
            }
        )
        return ""
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function":
        raise OpenAIError.bad(
            "tool_choice",
            'tool_choice must be "none", "required" or {"type": "function", "function": '
            '{"name": ...}}',
        )
    name = fn.get("name")
    if not isinstance(name, str) or name not in fns:
        raise OpenAIError.bad(
            "tool_choice",
            f"tool_choice names function {name!r}, which is not among the tools {sorted(fns)}",
        )
    sp.json_schema = json.dumps(fns[name])
    return name


def tool_call(text: str, forced: str) -> dict[str, Any] | None:
    """One entry of OpenAI's `tool_calls` from a forced call's constrained text; None when the
    text is not a whole call (the reply then keeps it as content, never a 500 or a broken
    stream)."""
    try:
        call = json.loads(text)
        if forced:
            name, arguments = forced, text
        else:
            name, arguments = call["name"], json.dumps(call["arguments"])
    except (ValueError, TypeError, KeyError):
        return None
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def as_tool_call(body: dict[str, Any], forced: str) -> dict[str, Any]:
    """A chat completion whose text is a forced call's JSON -> OpenAI's tool_calls shape (the
    text as is when it was cut short by max_tokens: finish_reason "length")."""
    choice = body["choices"][0]
    call = tool_call(choice["message"]["content"], forced)
    if choice["finish_reason"] != "stop" or call is None:
        return body
    choice["message"] = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [call],
    }
    choice["finish_reason"] = "tool_calls"
    return body


def as_tool_call_delta(body: dict[str, Any], forced: str) -> dict[str, Any]:
    """The same for the last chunk of a stream that held the whole text back."""
    choice = body["choices"][0]
    call = tool_call(choice["delta"].get("content", ""), forced)
    if choice["finish_reason"] != "stop" or call is None:
        return body
    choice["delta"] = {"tool_calls": [{"index": 0, **call}]}
    choice["finish_reason"] = "tool_calls"
    return body
