"""The OpenAI-compatible HTTP API of the router (aiohttp), on the router's own event loop:
listening, draining, and what every request goes through. The routes are http_routes.py.

Errors are OpenAI's {"error": {message, type, param, code}}, the status mapped from the gRPC
code (400, 404 unknown model, 409, 429 with `Retry-After` when waiting helps, 503, 504); a
body over max_request_bytes + 64 KiB is a 413 (http_routes.py: BODY_SLACK_BYTES); aiohttp's
own refusals (no such route, wrong method) and unexpected exceptions get the same shape here. A
stream sends its headers with the first chunk, so a request refused before any token gets a
real HTTP status; a failure after that is an error event, then `data: [DONE]` (http_sinks.py).
A client that
disconnects cancels its handler (aiohttp's handler_cancellation), which cancels the worker calls
exactly like a gRPC client cancel. Draining (router stop, SIGTERM) stops listening, answers new
requests 503 (but /health and /metrics), gives in-flight requests the grace period, then cancels
them. HTTPS when http.tls is set, else when server.tls is (docs/tls.md).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from splitserve.request.errors import RequestError
from splitserve.router.auth import Caller
from splitserve.router.context import RouterContext
from splitserve.router.frontend import Frontend
from splitserve.router.http_routes import CALLER, OpenAIRoutes, max_body_bytes
from splitserve.router.openai_errors import OpenAIError, error_from_request_error
from splitserve.service.net import local_dial_host
from splitserve.service.tls import TlsServerConfig, server_ssl_context

log = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def _nothing() -> None:
    return None


class _PeerErrorLog(logging.LoggerAdapter):
    """aiohttp's server logger, but a request its parser refuses (garbage bytes, a gRPC client's
    HTTP/2 preface, a bad header) is one INFO line instead of an ERROR with a traceback, so no
    peer can fill the log with tracebacks; anything else keeps its traceback. The line keeps the
    refusal's description, not the bytes aiohttp quotes after it (a header line that is too long
    or holds a control character may carry an API key)."""

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        if isinstance(exc_info, HttpProcessingError):
            text = str(exc_info.message)
            cut = min((i for i in map(text.find, "'\"\n") if i >= 0), default=len(text))
            described = re.sub(r"[\s:]*b?$", "", text[:cut])  # "...: b'<line>'" -> "..."
            why = " ".join(f"{type(exc_info).__name__}: {described}".split())[:200]
            self.logger.info(msg + " (refused: %s)", *args, why)
        else:
            self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)


class OpenAIServer:
    def __init__(self, ctx: RouterContext, frontend: Frontend, ready: Callable[[], bool]) -> None:
        self.ctx = ctx
        self.frontend = frontend
        self.ready = ready
        cfg = ctx.cfg
        self.host = cfg.http.host or cfg.server.host
        self.port: int | None = None
        self.app = web.Application(
            client_max_size=max_body_bytes(cfg), middlewares=[self._middleware]
        )
        self.routes = OpenAIRoutes(ctx, frontend, lambda: self.ready() and not self._draining)
        self.routes.add_to(self.app.router)
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
    @property
    def tls(self) -> TlsServerConfig | None:
        """HTTPS with http.tls, else with the gRPC port's server.tls; None: plain HTTP."""
        return self.ctx.cfg.http.tls or self.ctx.cfg.server.tls

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    async def start(self) -> None:
        # a bad certificate or key: TlsError (one line) before anything listens
        setting = "http.tls" if self.ctx.cfg.http.tls is not None else "server.tls"
        ssl_context = server_ssl_context(self.tls, setting) if self.tls is not None else None
        runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=1.0,
            logger=_PeerErrorLog(logging.getLogger("aiohttp.server"), {}),
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.ctx.cfg.http.port, ssl_context=ssl_context)
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
    def _admit(self, caller: Caller):
        try:
            return self.frontend.admit(caller)
        except RequestError as err:
            raise error_from_request_error(err, {}, "prompt") from None

    def _caller(self, request: web.Request, route: str) -> Caller:
        auth = self.frontend.auth
        try:
            caller = auth.caller(request.headers.get("Authorization"), request.remote or "")
            if route == "/metrics":
                auth.admin_only(caller, "/metrics on the public HTTP port")
        except RequestError as err:
            raise error_from_request_error(err, {}, "prompt") from None
        return caller

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        task = asyncio.current_task()
        self._handlers.add(task)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        status = 500
        release = _nothing
        try:
            if self._draining and route not in ("/health", "/metrics"):
                raise OpenAIError(
                    503, "the server is shutting down; retry on another replica", code="unavailable"
                )
            if route != "/health":  # probes stay open
                request[CALLER] = self._caller(request, route)
            if route in GENERATION_ROUTES:  # limits before the body is parsed or tokenized
                release = self._admit(request[CALLER])
            resp = await handler(request)
            status = resp.status
            return resp
        except OpenAIError as err:
            status = err.status
            return web.json_response(err.body(), status=err.status, headers=err.headers())
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
            release()
            self._handlers.discard(task)
            self.ctx.metrics.http_requests.labels(route, str(status)).inc()
