"""The one path every public request takes, whatever the transport: the gRPC Generate servicer
and the OpenAI HTTP front (http_server.py) both call `Frontend.generate`.

    GenerateRequest ──prepare (intake.py)──▶ PreparedRequest ──Generation.run──▶ sink.write(chunk) ...
                      │ RequestError: counted, raised      │ live[(scope, id)]: the caller's Abort finds it
                      └──────────── metrics: outcome, in flight, prompt tokens ──────────────┘

A transport hands in a `ChunkSink`: what Generation writes each GenerateResponse to and asks
for the time left (a grpc.aio ServicerContext is one as it is; the HTTP front writes server-sent
events or collects the chunks). Errors come back as `RequestError`s; the transport maps them
to its own status (gRPC status, HTTP code). A cancelled task (gRPC client cancel, HTTP client
gone) cancels the worker calls exactly as before: cleanup lives in Generation.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import grpc

from splitserve.protos import generate_pb2
from splitserve.request.errors import RequestError
from splitserve.router.auth import Authenticator, Caller
from splitserve.router.caller_limits import CallerLimits
from splitserve.router.context import RouterContext
from splitserve.router.generation import Generation
from splitserve.router.generation_base import LiveRequest
from splitserve.router.intake import prepare

log = logging.getLogger(__name__)

LOCAL = Caller("local", admin=True)  # in-process callers (tests, tools built on Frontend)


class ChunkSink(Protocol):
    """Where a Generation's chunks go (grpc.aio.ServicerContext satisfies it)."""

    async def write(self, chunk: generate_pb2.GenerateResponse) -> None: ...

    def time_remaining(self) -> float | None: ...


class Frontend:
    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx
        self.auth = Authenticator(ctx.cfg)
        self.limits = CallerLimits(ctx.cfg.auth)
        # in flight by (caller scope, the caller's request id): ids are the caller's own
        self.live: dict[tuple[str, str], LiveRequest] = {}

    async def generate(
        self,
        request: generate_pb2.GenerateRequest,
        sink: ChunkSink,
        arrival: float | None = None,
        caller: Caller | None = None,
        admitted: bool = False,
    ) -> None:
        """Validates and runs one request, writing its chunks to `sink`; RequestError on failure
        (validation before any worker is touched, or a worker failure later). `caller`: who
        sent it (auth.py); None: a trusted in-process caller. `admitted`: the transport already
        passed the caller's limits (`admit`) before its own parsing work."""
        arrival = time.monotonic() if arrival is None else arrival
        caller = caller or LOCAL
        release = (lambda: None) if admitted else self.admit(caller)
        try:
            await self._run(request, sink, arrival, caller)
        finally:
            release()

    async def _run(
        self, request: generate_pb2.GenerateRequest, sink: ChunkSink, arrival: float, caller: Caller
    ) -> None:
        m = self.ctx.metrics
        try:
            req = await prepare(request, self.ctx.model, self.ctx.cfg)
            key = (caller.scope, req.client_request_id)
            if key in self.live:
                raise RequestError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request_id {req.client_request_id!r} is already in flight for you on this "
                    "router; give every request a unique id, or leave it empty for the router to "
                    "assign one",
                )
        except RequestError as err:
            m.requests.labels(err.code.name.lower()).inc()
            raise
        live = self.live[key] = LiveRequest(req.request_id)
        gen = Generation(self.ctx, req, live, sink, arrival)  # type: ignore[arg-type]  # any ChunkSink
        m.in_flight.inc()
        m.prompt_tokens.inc(len(req.prompt))
        try:
            await gen.run()
        except RequestError as err:
            gen.outcome = err.code.name.lower()
            log.info("%s ended: %s: %s", req.request_id, err.code.name, err.message)
            raise
        finally:
            if self.live.get(key) is live:
                del self.live[key]
            m.in_flight.dec()
            m.requests.labels(gen.outcome).inc()

    def admit(self, caller: Caller):
        """The caller's rate and concurrency limits (caller_limits.py); a release callback, or
        RequestError(RESOURCE_EXHAUSTED) with a retry hint (counted)."""
        try:
            return self.limits.admit(caller.scope)
        except RequestError as err:
            self.ctx.metrics.requests.labels(err.code.name.lower()).inc()
            raise

    def abort(self, request_id: str, caller: Caller | None = None) -> bool:
        """Ends the caller's in-flight request with FINISH_REASON_ABORT (an admin's: anyone's
        with that id); False when none is in flight."""
        caller = caller or LOCAL
        if caller.admin:
            found = [live for (_, rid), live in self.live.items() if rid == request_id]
        else:
            found = [self.live[k] for k in [(caller.scope, request_id)] if k in self.live]
        found = [live for live in found if not live.aborted]
        for live in found:
            live.abort()
        return bool(found)
