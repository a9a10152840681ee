"""GenerateService (the public API) and RouterControl (worker registration) servicers.

Generate streams with `context.write` rather than an async generator, so a client cancel or
an expired deadline raises inside the handler at once and its cleanup (cancelling worker
calls, releasing a lease) runs right then, not when a suspended generator is collected.
"""

from __future__ import annotations

import logging
import time

import grpc

from splitserve.engine.errors import RequestError
from splitserve.protos import generate_pb2, generate_pb2_grpc, router_pb2, router_pb2_grpc
from splitserve.router.context import RouterContext
from splitserve.router.generation import Generation, LiveRequest
from splitserve.router.intake import prepare

log = logging.getLogger(__name__)


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx
        self.live: dict[str, LiveRequest] = {}

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        arrival = time.monotonic()
        m = self.ctx.metrics
        try:
            req = await prepare(request, self.ctx.model, self.ctx.cfg)
            if req.request_id in self.live:
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"request_id {req.request_id!r} is already in flight on this router; give every "
                                   "request a unique id, or leave it empty for the router to assign one")
        except RequestError as err:
            m.requests.labels(err.code.name.lower()).inc()
            await err.abort(context)
        live = self.live[req.request_id] = LiveRequest(req.request_id)
        gen = Generation(self.ctx, req, live, context, arrival)
        m.in_flight.inc()
        m.prompt_tokens.inc(len(req.prompt))
        try:
            await gen.run()
        except RequestError as err:
            gen.outcome = err.code.name.lower()
            log.info("%s ended: %s: %s", req.request_id, err.code.name, err.message)
            await err.abort(context)
        finally:
            if self.live.get(req.request_id) is live:
                del self.live[req.request_id]
            m.in_flight.dec()
            m.requests.labels(gen.outcome).inc()

    async def Abort(self, request: generate_pb2.AbortRequest, context) -> generate_pb2.AbortResponse:
        live = self.live.get(request.request_id)
        if live is None or live.aborted:
            return generate_pb2.AbortResponse(found=False)
        live.abort()
        return generate_pb2.AbortResponse(found=True)

    async def GetServerInfo(self, request, context) -> generate_pb2.ServerInfo:
        model = self.ctx.model
        workers = self.ctx.registry.workers()
        block_size = next((w.load.block_size for w in workers if w.load.block_size), 0)
        return generate_pb2.ServerInfo(
            model_name=model.name, max_model_len=model.max_model_len, vocab_size=model.vocab_size,
            block_size=block_size,
            workers=[generate_pb2.WorkerInfo(role=w.role, address=w.address, healthy=w.healthy) for w in workers])


class RouterControlServicer(router_pb2_grpc.RouterControlServicer):
    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx

    async def RegisterWorker(self, request: router_pb2.RegisterWorkerRequest, context) -> (
            router_pb2.RegisterWorkerResponse):
        try:
            self.ctx.registry.register(request.role, request.address)
        except RequestError as err:
            await err.abort(context)
        rc = self.ctx.cfg.registry
        return router_pb2.RegisterWorkerResponse(heartbeat_interval_ms=int(rc.heartbeat_interval_s * 1000),
                                                 heartbeat_timeout_ms=int(rc.heartbeat_timeout_s * 1000))

    async def Heartbeat(self, request: router_pb2.HeartbeatRequest, context) -> router_pb2.HeartbeatResponse:
        return router_pb2.HeartbeatResponse(known=self.ctx.registry.heartbeat(request.role, request.address))
