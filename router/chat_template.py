"""Chat messages -> prompt token ids, through the checkpoint's chat template (Tokenizer.from_dir
finds it where transformers does), rendered the way Hugging Face's `apply_chat_template` does:

    template the model's one, or of its named ones `tool_use` when tools are passed, else `default`
    jinja2 ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols, {% generation %})
      globals  raise_exception(msg) (a TemplateError: the client gets a 400 with msg), strftime_now,
               namespace (refuses _names) and dict as transformers' sandbox-hardened ones
      filter   tojson (ensure_ascii=False, like transformers)
      context  messages (keys whose value is None dropped, reasoning_content aliased),
               add_generation_prompt=True, tools (the request's, or None), documents=None, and
               the special tokens (bos_token, eos_token, unk_token, pad_token, ...)
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
from splitserve.request.tokenizer import TEMPLATE_PLACES, Tokenizer

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


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without the type itself (transformers' TemplateDict)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace that refuses _names, so a template cannot stash dunders (as transformers)."""

    def __init__(*args, **kwargs):  # jinja's signature trick: namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
            )


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """transformers drops None values (templates test `is defined`, and would print 'None') and
    fills reasoning_content and thinking (gpt-oss templates) from whichever reasoning key is set."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    model_name: str,
    tools: list[dict[str, Any]] | None = None,
    template_name: str | None = None,
) -> str:
    """The prompt text, or RequestError: 400 for a model without a (fitting) template or a
    conversation the template refuses (raise_exception), INTERNAL for a template that does not
    compile. `template_name` picks one of a model's named templates (transformers' chat_template=)."""
    try:
        source = tokenizer.get_chat_template(template_name, tools)
    except ValueError as exc:
        raise RequestError.invalid(f"model {model_name!r}: {exc}") from None
    if not source:
        raise RequestError.invalid(
            f"model {model_name!r} has no chat_template (looked in {TEMPLATE_PLACES}), so it "
            "cannot take chat messages; send the prompt text to /v1/completions, or add a "
            "chat_template.jinja to the checkpoint"
        )
    if not messages:
        raise RequestError.invalid("messages: a chat needs at least one message")
    try:
        template = compile_template(source)
    except jinja2.exceptions.TemplateError as exc:
        raise RequestError(
            grpc.StatusCode.INTERNAL,
            f"the chat_template of model {model_name!r} does not compile ({exc}); fix it in the checkpoint",
        ) from None
    try:
        return template.render(
            messages=_template_messages(messages),
            add_generation_prompt=True,
            tools=tools,  # the template shows the model the tools (forced tool calls)
            documents=None,
            **tokenizer.template_tokens,
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
    template_name: str | None = None,
) -> list[int]:
    text = render_chat(tokenizer, messages, model_name, tools, template_name)
    if len(text) > _TOKENIZE_IN_THREAD:
        return await asyncio.to_thread(tokenizer.encode, text, False)
    return tokenizer.encode(text, add_special_tokens=False)
