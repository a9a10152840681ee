"""The one path every public request takes, whatever the transport: the gRPC Generate servicer
and the OpenAI HTTP front (http_server.py) both call `Frontend.generate`.

    GenerateRequest ──prepare (intake.py)──▶ PreparedRequest ──Generation.run──▶ sink.write(chunk) ...
                      │ RequestError: counted, raised      │ live[request_id]: Abort finds it
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
from splitserve.router.context import RouterContext
from splitserve.router.generation import Generation
from splitserve.router.generation_base import LiveRequest
from splitserve.router.intake import prepare

log = logging.getLogger(__name__)


class ChunkSink(Protocol):
    """Where a Generation's chunks go (grpc.aio.ServicerContext satisfies it)."""

    async def write(self, chunk: generate_pb2.GenerateResponse) -> None: ...

    def time_remaining(self) -> float | None: ...


class Frontend:
    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx
        self.live: dict[str, LiveRequest] = {}

    async def generate(
        self, request: generate_pb2.GenerateRequest, sink: ChunkSink, arrival: float | None = None
    ) -> None:
        """Validates and runs one request, writing its chunks to `sink`; RequestError on failure
        (validation before any worker is touched, or a worker failure later)."""
        arrival = time.monotonic() if arrival is None else arrival
        m = self.ctx.metrics
        try:
            req = await prepare(request, self.ctx.model, self.ctx.cfg)
            if req.request_id in self.live:
                raise RequestError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request_id {req.request_id!r} is already in flight on this router; give every "
                    "request a unique id, or leave it empty for the router to assign one",
                )
        except RequestError as err:
            m.requests.labels(err.code.name.lower()).inc()
            raise
        live = self.live[req.request_id] = LiveRequest(req.request_id)
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
            if self.live.get(req.request_id) is live:
                del self.live[req.request_id]
            m.in_flight.dec()
            m.requests.labels(gen.outcome).inc()

    def abort(self, request_id: str) -> bool:
        """Ends an in-flight request with FINISH_REASON_ABORT; False when none is in flight."""
        live = self.live.get(request_id)
        if live is None or live.aborted:
            return False
        live.abort()
        return True
