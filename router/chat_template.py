"""Chat messages -> prompt token ids, through the checkpoint's `chat_template`
(tokenizer_config.json), rendered the way Hugging Face's `apply_chat_template` renders it:

    jinja2 ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols, {% generation %})
      globals  raise_exception(msg) (a TemplateError: the client gets a 400 with msg), strftime_now
      filter   tojson (ensure_ascii=False, like transformers)
      context  messages, add_generation_prompt=True, bos_token, eos_token, tools (the request's, or
               None), documents=None
    the rendered text is tokenized with add_special_tokens=False (the template holds the bos)

A model without a template is a 400 that says so (use /v1/completions). Message content given
as a list of text parts is joined with newlines (vLLM's "string" content format); other parts
(images, audio) are refused.
"""

from __future__ import annotations

import asyncio
import functools
import json
from datetime import datetime
from typing import Any

import grpc
import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from splitserve.request.errors import RequestError
from splitserve.request.tokenizer import Tokenizer

_TOKENIZE_IN_THREAD = 32_768  # characters, as intake.py


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render(caller) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    model_name: str,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text, or RequestError: 400 for a model without a template or a conversation the
    template refuses (raise_exception), INTERNAL for a template that does not compile."""
    if not tokenizer.chat_template:
        raise RequestError.invalid(
            f"model {model_name!r} has no chat_template in its tokenizer_config.json, so it cannot take chat "
            "messages; send the prompt text to /v1/completions, or add a chat_template to the checkpoint"
        )
    try:
        template = compile_template(tokenizer.chat_template)
    except jinja2.exceptions.TemplateError as exc:
        raise RequestError(
            grpc.StatusCode.INTERNAL,
            f"the chat_template of model {model_name!r} does not "
            f"compile ({exc}); fix tokenizer_config.json",
        ) from None
    context = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    try:
        return template.render(
            messages=messages,
            add_generation_prompt=True,
            tools=tools,  # the template shows the model the tools (forced tool calls)
            documents=None,
            **{k: v for k, v in context.items() if v is not None},
        )
    except jinja2.exceptions.TemplateError as exc:
        raise RequestError.invalid(
            f"messages: the model's chat template refused them: {exc}"
        ) from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise RequestError.invalid(
            f"messages: the model's chat template failed on them ({type(exc).__name__}: {exc})"
        ) from None


async def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    model_name: str,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    text = render_chat(tokenizer, messages, model_name, tools)
    if len(text) > _TOKENIZE_IN_THREAD:
        return await asyncio.to_thread(tokenizer.encode, text, False)
    return tokenizer.encode(text, add_special_tokens=False)
