"""The OpenAI-compatible HTTP API of the router (aiohttp), on the router's own event loop.

    POST /v1/completions        prompt text or token ids  ─┐ openai_protocol.py: body -> GenerateRequest
    POST /v1/chat/completions   messages -> chat_template ─┤ Frontend.generate: the gRPC Generate path
                                                           │   (validation, routing, retries, metrics)
                                 chunks -> SSE or one JSON ◀┘ openai_response.py
    GET  /v1/models[/{id}]      the served model (id, max_model_len, vocab_size)
    GET  /health                200 while >= 1 healthy prefill and >= 1 healthy decode worker, else 503
    GET  /metrics               the router's Prometheus registry (the one the gRPC side exports)

Errors are OpenAI's {"error": {message, type, param, code}}, the status mapped from the gRPC
code (400, 404 unknown model, 409, 429, 503, 504). A stream sends its headers with the first
chunk, so a request refused before any token gets a real HTTP status; a failure after that is an
error event, then `data: [DONE]`. A client that disconnects cancels its handler (aiohttp's
handler_cancellation), which cancels the worker calls exactly like a gRPC client cancel.
Draining (router stop, SIGTERM) stops listening, gives in-flight requests the grace period, then
cancels them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from splitserve.protos import generate_pb2
from splitserve.request.errors import RequestError
from splitserve.router.chat_template import chat_prompt_ids
from splitserve.router.context import RouterContext
from splitserve.router.frontend import Frontend
from splitserve.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    error_from_request_error,
    parse,
)
from splitserve.router.openai_response import ResponseBuilder
from splitserve.router.registry import DECODE, PREFILL
from splitserve.service.net import local_dial_host

log = logging.getLogger(__name__)


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class _Collect:
    """Sink of a non-streamed request: keeps the chunks."""

    def __init__(self) -> None:
        self.chunks: list[generate_pb2.GenerateResponse] = []

    async def write(self, chunk: generate_pb2.GenerateResponse) -> None:
        self.chunks.append(chunk)

    def time_remaining(self) -> float | None:
        return None


class _EventStream:
    """Sink of a streamed request: server-sent events, headers sent with the first chunk."""

    def __init__(self, request: web.Request, builder: ResponseBuilder) -> None:
        self.request = request
        self.builder = builder
        self.resp: web.StreamResponse | None = None
        self.usage: generate_pb2.Usage | None = None

    def time_remaining(self) -> float | None:
        return None

    async def send(self, body: dict[str, Any]) -> None:
        await self.resp.write(b"data: " + _dumps(body) + b"\n\n")

    async def start(self) -> None:
        self.resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": self.builder.id,
            }
        )
        await self.resp.prepare(self.request)
        if self.builder.kind == "chat":
            await self.send(self.builder.role_chunk())

    async def write(self, chunk: generate_pb2.GenerateResponse) -> None:
        if self.resp is None:
            await self.start()
        if chunk.finish_reason:
            self.usage = chunk.usage
        body = self.builder.stream_chunk(chunk)
        if body is not None:
            await self.send(body)

    async def close(self, error: OpenAIError | None = None) -> web.StreamResponse:
        if self.resp is None:
            await self.start()
        if error is not None:
            await self.send(error.body())
        elif self.builder.include_usage and self.usage is not None:
            await self.send(self.builder.usage_chunk(self.usage))
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp


class OpenAIServer:
    def __init__(self, ctx: RouterContext, frontend: Frontend, ready: Callable[[], bool]) -> None:
        self.ctx = ctx
        self.frontend = frontend
        self.ready = ready
        cfg = ctx.cfg
        self.host = cfg.http.host or cfg.server.host
        self.port: int | None = None
        self.created = int(time.time())
        self.app = web.Application(
            client_max_size=4 * cfg.max_request_bytes, middlewares=[self._middleware]
        )
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model_id:.+}", self.model)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self._runner: web.AppRunner | None = None
        self._handlers: set[asyncio.Task] = set()
        self._draining = False

    @property
    def address(self) -> str:
        if self.ctx.cfg.http.host is None:
            host = self.ctx.cfg.server.public_host
        else:
            host = local_dial_host(self.host)
        return f"{host}:{self.port}"

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.ctx.cfg.http.port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise RuntimeError(
                f"cannot listen on {self.host}:{self.ctx.cfg.http.port} for the HTTP API "
                f"({exc.strerror}); pick another --http-port (0 picks a free one)"
            ) from None
        self._runner = runner
        self.port = runner.addresses[0][1]

    async def drain(self, grace_s: float) -> None:
        """Stop listening, give in-flight requests `grace_s`, cancel the rest. Idempotent."""
        self._draining = True
        runner, self._runner = self._runner, None
        if runner is None:
            return
        for site in list(runner.sites):
            await site.stop()
        pending = set(self._handlers)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        await runner.cleanup()

    # ---- every request ---------------------------------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        task = asyncio.current_task()
        self._handlers.add(task)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        status = 500
        try:
            if self._draining and route not in ("/health", "/metrics"):
                raise OpenAIError(
                    503, "the server is shutting down; retry on another replica", code="unavailable"
                )
            resp = await handler(request)
            status = resp.status
            return resp
        except OpenAIError as err:
            status = err.status
            return web.json_response(err.body(), status=err.status)
        except (
            web.HTTPException
        ) as exc:  # no such route (404), wrong method (405), body too large (413)
            status = exc.status
            err = OpenAIError(
                exc.status,
                f"{request.method} {request.path}: {exc.reason}",
                code=exc.reason.lower().replace(" ", "_"),
            )
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return web.json_response(err.body(), status=exc.status, headers=allow)
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away
            status = 499
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            err = OpenAIError(500, "internal error in the router; see its log", code="internal")
            return web.json_response(err.body(), status=500)
        finally:
            self._handlers.discard(task)
            self.ctx.metrics.http_requests.labels(route, str(status)).inc()

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise OpenAIError.bad(None, f"the request body is not valid JSON ({exc})") from None

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
        return request.headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex}"

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
        model = self.ctx.model
        try:
            ids = await chat_prompt_ids(
                model.tokenizer, [m.as_template_input() for m in req.messages], model.name
            )
        except RequestError as err:
            oe = error_from_request_error(err, {}, "messages")
            oe.param = "messages"
            raise oe from None
        rid = self._request_id(request, "chatcmpl")
        builder = ResponseBuilder(
            "chat", rid, model.name, model.tokenizer, req.logprobs, req.include_usage
        )
        return await self._generate(
            request, req.to_generate(rid, ids), builder, req.stream, req.names(), "messages"
        )

    async def _generate(
        self,
        request: web.Request,
        gen: generate_pb2.GenerateRequest,
        builder: ResponseBuilder,
        stream: bool,
        names: dict[str, str],
        prompt_param: str,
    ) -> web.StreamResponse:
        if not stream:
            sink = _Collect()
            try:
                await self.frontend.generate(gen, sink)
            except RequestError as err:
                raise error_from_request_error(err, names, prompt_param) from None
            return web.json_response(
                builder.full(sink.chunks),
                dumps=lambda b: _dumps(b).decode(),
                headers={"X-Request-Id": builder.id},
            )
        events = _EventStream(request, builder)
        try:
            await self.frontend.generate(gen, events)
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
        ok = self.ready() and not self._draining
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
