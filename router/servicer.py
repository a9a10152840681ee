"""GenerateService (the public API) and RouterControl (worker registration) servicers.

Generate streams with `context.write` rather than an async generator, so a client cancel or
an expired deadline raises inside the handler at once and its cleanup (cancelling worker
calls, releasing a lease) runs right then, not when a suspended generator is collected.
The request itself runs through `Frontend` (frontend.py), the path the HTTP front shares.
"""

from __future__ import annotations

import time

import grpc

from splitserve.protos import generate_pb2, generate_pb2_grpc, router_pb2, router_pb2_grpc
from splitserve.request.errors import RequestError
from splitserve.router.auth import AUTHORIZATION, Authenticator, Caller, grpc_peer_host
from splitserve.router.context import RouterContext
from splitserve.router.frontend import Frontend


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else None
    return None


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, ctx: RouterContext, frontend: Frontend | None = None) -> None:
        self.ctx = ctx
        self.frontend = frontend or Frontend(ctx)
        self.live = self.frontend.live  # in-flight requests of every transport

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        return self.frontend.auth.caller(
            metadata_value(context, AUTHORIZATION), grpc_peer_host(context.peer())
        )

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        arrival = time.monotonic()
        try:
            await self.frontend.generate(request, context, arrival, self._caller(context))
        except RequestError as err:
            await err.abort(context)

    async def Abort(
        self, request: generate_pb2.AbortRequest, context
    ) -> generate_pb2.AbortResponse:
        try:
            caller = self._caller(context)
        except RequestError as err:
            await err.abort(context)
        return generate_pb2.AbortResponse(found=self.frontend.abort(request.request_id, caller))

    async def GetServerInfo(self, request, context) -> generate_pb2.ServerInfo:
        try:
            caller = self._caller(context)
        except RequestError as err:
            await err.abort(context)
        model = self.ctx.model
        workers = self.ctx.registry.workers()
        block_size = next((w.load.block_size for w in workers if w.load.block_size), 0)
        return generate_pb2.ServerInfo(
            model_name=model.name,
            max_model_len=model.max_model_len,
            vocab_size=model.vocab_size,
            block_size=block_size,
            workers=[  # addresses are for admins: who knows them can reach the workers directly
                generate_pb2.WorkerInfo(
                    role=w.role, address=w.address if caller.admin else "", healthy=w.healthy
                )
                for w in workers
            ],
        )


class RouterControlServicer(router_pb2_grpc.RouterControlServicer):
    """Served on the private control listener (control.port), else on the public port; either
    way a caller must hold the cluster secret when one is set (auth.py)."""

    def __init__(self, ctx: RouterContext, auth: Authenticator, private: bool) -> None:
        self.ctx = ctx
        self.auth = auth
        self.private = private

    async def _check(self, context) -> None:
        try:
            self.auth.check_cluster(metadata_value(context, AUTHORIZATION), self.private)
        except RequestError as err:
            await err.abort(context)

    async def RegisterWorker(
        self, request: router_pb2.RegisterWorkerRequest, context
    ) -> router_pb2.RegisterWorkerResponse:
        await self._check(context)
        try:
            await self.ctx.registry.register_checked(request.role, request.address)
        except RequestError as err:
            await err.abort(context)
        rc = self.ctx.cfg.registry
        return router_pb2.RegisterWorkerResponse(
            heartbeat_interval_ms=int(rc.heartbeat_interval_s * 1000),
            heartbeat_timeout_ms=int(rc.heartbeat_timeout_s * 1000),
        )

    async def Heartbeat(
        self, request: router_pb2.HeartbeatRequest, context
    ) -> router_pb2.HeartbeatResponse:
        await self._check(context)
        return router_pb2.HeartbeatResponse(
            known=self.ctx.registry.heartbeat(request.role, request.address)
        )
