"""The OpenAI-compatible HTTP API of the router (aiohttp), on the router's own event loop:
listening, draining, and what every request goes through. The routes are http_routes.py.

Errors are OpenAI's {"error": {message, type, param, code}}, the status mapped from the gRPC
code (400, 404 unknown model, 409, 429, 503, 504); aiohttp's own refusals (no such route, wrong
method, body too large) and unexpected exceptions get the same shape here. A stream sends its
headers with the first chunk, so a request refused before any token gets a real HTTP status; a
failure after that is an error event, then `data: [DONE]` (http_sinks.py). A client that
disconnects cancels its handler (aiohttp's handler_cancellation), which cancels the worker calls
exactly like a gRPC client cancel. Draining (router stop, SIGTERM) stops listening, answers new
requests 503 (but /health and /metrics), gives in-flight requests the grace period, then cancels
them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from splitserve.router.context import RouterContext
from splitserve.router.frontend import Frontend
from splitserve.router.http_routes import OpenAIRoutes
from splitserve.router.openai_errors import OpenAIError
from splitserve.service.net import local_dial_host

log = logging.getLogger(__name__)


class OpenAIServer:
    def __init__(self, ctx: RouterContext, frontend: Frontend, ready: Callable[[], bool]) -> None:
        self.ctx = ctx
        self.frontend = frontend
        self.ready = ready
        cfg = ctx.cfg
        self.host = cfg.http.host or cfg.server.host
        self.port: int | None = None
        self.app = web.Application(
            client_max_size=4 * cfg.max_request_bytes, middlewares=[self._middleware]
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
