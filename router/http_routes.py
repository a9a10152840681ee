"""The handlers of the router's OpenAI-compatible HTTP API (http_server.py runs the server).

    POST /v1/completions        prompt text or token ids  ─┐ openai_protocol.py: body -> GenerateRequest
    POST /v1/chat/completions   messages -> chat_template ─┤ Frontend.generate: the gRPC Generate path
                                                           │   (validation, routing, retries, metrics)
                                 chunks -> SSE or one JSON ◀┘ http_sinks.py, openai_response.py
    GET  /v1/models[/{id}]      the served model (id, max_model_len, vocab_size)
    GET  /health                200 while ready (>= 1 healthy prefill and >= 1 healthy decode
                                worker) and not draining, else 503
    GET  /metrics               the router's Prometheus registry (the one the gRPC side exports);
                                admin key only, unless the router has no keys and is loopback-only

Every route but /health needs an API key when the router has keys (http_server.py, auth.py):
401 in OpenAI's error shape without one.

Limits before work: a body over max_request_bytes + BODY_SLACK_BYTES is a 413 before it is read
whole; a chat whose messages hold more than max_prompt_bytes of content is a 400 before the
template renders it (completions' prompt text: intake.py, the same limit).

A handler raises OpenAIError (openai_errors.py) for anything it refuses; the server's middleware
answers it. A streamed request that fails after its first chunk ends with an error event instead.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from splitserve.protos import generate_pb2
from splitserve.request.errors import RequestError
from splitserve.router.chat_template import chat_prompt_ids
from splitserve.router.config import RouterConfig
from splitserve.router.context import RouterContext
from splitserve.router.frontend import Frontend
from splitserve.router.http_sinks import CollectedChunks, EventStream, ToolCallStream, json_bytes
from splitserve.router.intake import prompt_too_big
from splitserve.router.openai_errors import OpenAIError, error_from_request_error, parse
from splitserve.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from splitserve.router.openai_response import ResponseBuilder
from splitserve.router.openai_structured import as_tool_call
from splitserve.router.worker_state import DECODE, PREFILL

CALLER = "splitserve.caller"  # request key set by the server's middleware (auth.py's Caller)
# A body may exceed max_request_bytes by this much: the JSON around the prompt (parameters,
# escapes, up to 300 logit_bias entries, stop strings). More is a 413 before it is read whole.
BODY_SLACK_BYTES = 64 * 2**10


def max_body_bytes(cfg: RouterConfig) -> int:
    """The HTTP front's body limit: max_request_bytes plus BODY_SLACK_BYTES."""
    return cfg.max_request_bytes + BODY_SLACK_BYTES


MAX_JSON_DEPTH = 32  # nesting of a request body: messages[i].content[j].text needs 5


def _too_deep() -> OpenAIError:
    return OpenAIError.bad(None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")


def _checked_json(body: Any) -> Any:
    """The parsed body, or a 400 when it nests deeper than MAX_JSON_DEPTH (nothing we take needs
    that, and deep values reach recursive code) or holds a lone surrogate (JSON's "\\ud800"
    escape: no character, so neither protobuf nor the tokenizer can take it)."""
    stack = [(body, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise _too_deep()
            if isinstance(value, dict):
                stack.extend((k, depth + 1) for k in value)
                value = value.values()
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str) and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise OpenAIError.bad(
                    None,
                    "the request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                    "that is not half of a pair), which is no character; send valid Unicode text",
                ) from None
    return body


class OpenAIRoutes:
    """The route handlers; `ready` says whether /health answers 200 (the server adds draining)."""

    def __init__(self, ctx: RouterContext, frontend: Frontend, ready: Callable[[], bool]) -> None:
        self.ctx = ctx
        self.frontend = frontend
        self.ready = ready
        self.created = int(time.time())

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/completions", self.completions)
        router.add_post("/v1/chat/completions", self.chat_completions)
        router.add_get("/v1/models", self.models)
        router.add_get("/v1/models/{model_id:.+}", self.model)
        router.add_get("/health", self.health)
        router.add_get("/metrics", self.metrics)

    # ---- request helpers ---------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> Any:
        limit = max_body_bytes(self.ctx.cfg)
        too_large = OpenAIError(
            413,
            f"the request body is over this server's limit of {limit} bytes (max_request_bytes "
            f"{self.ctx.cfg.max_request_bytes} plus {BODY_SLACK_BYTES} for the JSON around the "
            "prompt); send a shorter prompt",
            code="request_too_large",
        )
        if (request.content_length or 0) > limit:  # refused before reading it
            raise too_large
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past the limit
            raise too_large from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise OpenAIError.bad(None, f"the request body is not valid JSON ({exc})") from None
        except RecursionError:  # deeper than the interpreter's recursion limit
            raise _too_deep() from None
        return _checked_json(body)

    def _check_model(self, name: str | None) -> None:
        served = self.ctx.model.name
        if name is not None and name != served:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist; this server serves `{served}` "
                "(GET /v1/models)",
                "model",
                "model_not_found",
            )

    @staticmethod
    def _request_id(request: web.Request, prefix: str) -> str:
        rid = request.headers.get("X-Request-Id")
        if rid and not rid.isprintable():  # undecodable header bytes arrive as surrogate escapes
            raise OpenAIError.bad(
                "X-Request-Id",
                "the X-Request-Id header must be printable UTF-8 text; use a short printable id, "
                "or leave it out for the router to assign one",
            )
        return rid or f"{prefix}-{uuid.uuid4().hex}"

    # ---- generation ------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse(CompletionRequest, await self._body(request))
        self._check_model(req.model)
        rid = self._request_id(request, "cmpl")
        builder = ResponseBuilder(
            "completion",
            rid,
            self.ctx.model.name,
            self.ctx.model.tokenizer,
            req.logprobs is not None,
            req.include_usage,
        )
        return await self._generate(
            request, req.to_generate(rid), builder, req.stream, req.names(), "prompt"
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse(ChatCompletionRequest, await self._body(request))
        self._check_model(req.model)
        req.check_tools()
        model = self.ctx.model
        messages = [m.as_template_input() for m in req.messages]
        limit = self.ctx.cfg.max_prompt_bytes
        if (size := prompt_too_big([m["content"] or "" for m in messages], limit)) is not None:
            raise OpenAIError.bad(
                "messages",
                f"messages hold {size} bytes of content, over this server's limit of {limit} "
                "bytes (max_prompt_bytes); send shorter messages",
            )
        try:
            ids = await chat_prompt_ids(model.tokenizer, messages, model.name, req.template_tools())
        except RequestError as err:
            oe = error_from_request_error(err, {}, "messages")
            oe.param = "messages"
            raise oe from None
        rid = self._request_id(request, "chatcmpl")
        builder = ResponseBuilder(
            "chat", rid, model.name, model.tokenizer, req.logprobs, req.include_usage
        )
        gen = req.to_generate(rid, ids)
        return await self._generate(
            request, gen, builder, req.stream, req.names(), "messages", req.forced_tool
        )

    async def _generate(
        self,
        request: web.Request,
        gen: generate_pb2.GenerateRequest,
        builder: ResponseBuilder,
        stream: bool,
        names: dict[str, str],
        prompt_param: str,
        forced_tool: str | None = None,
    ) -> web.StreamResponse:
        """`forced_tool` (None: no call): the output is a forced tool call's JSON, returned in
        OpenAI's tool_calls shape (openai_structured.py)."""
        if not stream:
            sink = CollectedChunks()
            try:
                await self.frontend.generate(gen, sink, caller=request[CALLER], admitted=True)
            except RequestError as err:
                raise error_from_request_error(err, names, prompt_param) from None
            body = builder.full(sink.chunks)
            return web.json_response(
                body if forced_tool is None else as_tool_call(body, forced_tool),
                dumps=lambda b: json_bytes(b).decode(),
                headers={"X-Request-Id": builder.id},
            )
        events = (
            EventStream(request, builder)
            if forced_tool is None
            else ToolCallStream(request, builder, forced_tool)
        )
        try:
            await self.frontend.generate(gen, events, caller=request[CALLER], admitted=True)
        except RequestError as err:
            error = error_from_request_error(err, names, prompt_param)
            if events.resp is None:  # nothing sent yet: a plain HTTP error
                raise error from None
            return await events.close(error)
        return await events.close()

    # ---- the rest --------------------------------------------------------------------------------
    def _card(self) -> dict[str, Any]:
        m = self.ctx.model
        return {
            "id": m.name,
            "object": "model",
            "created": self.created,
            "owned_by": "splitserve",
            "max_model_len": m.max_model_len,
            "vocab_size": m.vocab_size,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model_id"])
        return web.json_response(self._card())

    async def health(self, request: web.Request) -> web.Response:
        reg = self.ctx.registry
        ok = self.ready()
        body = {
            "status": "ok" if ok else "unavailable",
            "healthy_prefill": len(reg.healthy(PREFILL)),
            "healthy_decode": len(reg.healthy(DECODE)),
        }
        return web.json_response(body, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.ctx.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )
