"""A whole router process: gRPC server (GenerateService + RouterControl, health, reflection),
worker registry, metrics, drain.

    start():  load tokenizer + config.json -> bind (gRPC, then the OpenAI HTTP front when
              http.port is set: http_server.py) -> probe workers
              health of GenerateService (and ''): SERVING while at least one prefill and one
              decode worker are healthy (colocated: one decode worker); RouterControl: SERVING
              from the start
    stop():   NOT_SERVING, refuse new calls (gRPC and HTTP), in-flight streams get the grace period (then
              they are cancelled, releasing their leases), background releases finish,
              probes stop
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.protos import generate_pb2, generate_pb2_grpc, router_pb2, router_pb2_grpc
from splitserve.router.config import RouterConfig
from splitserve.router.context import RouterContext
from splitserve.router.frontend import Frontend
from splitserve.router.intake import ModelInfo
from splitserve.router.metrics import RouterMetrics
from splitserve.router.registry import WorkerRegistry
from splitserve.router.servicer import GenerateServicer, RouterControlServicer
from splitserve.router.worker_state import DECODE, PREFILL
from splitserve.service.grpc_service import (
    NOT_SERVING,
    SERVING,
    GrpcServer,
    run_service,
    service_name,
)

log = logging.getLogger("splitserve.router")

SERVICE_NAME = service_name(generate_pb2.DESCRIPTOR, "GenerateService")
CONTROL_NAME = service_name(router_pb2.DESCRIPTOR, "RouterControl")


# over max_request_bytes by up to this much: refused by intake.py with its own message (the
# limit, how to fix it); beyond it, by gRPC before the message is read whole
RECEIVE_SLACK_BYTES = 2 * 2**20


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.registry = WorkerRegistry(cfg, self.metrics, on_change=self._health_changed)
        self.ctx = RouterContext(cfg, ModelInfo.load(cfg), self.registry, self.metrics)
        # strangers reach this port: gRPC reads a whole message before the key check runs, so
        # it takes no more than a request may be (intake.py says why a bigger one is refused)
        receive = min(
            cfg.max_request_bytes + RECEIVE_SLACK_BYTES, cfg.server.max_message_mb * 2**20
        )
        self.server = GrpcServer(cfg.server, self.metrics.registry, max_receive_bytes=receive)
        self.frontend = Frontend(self.ctx)  # the one request path, shared by gRPC and HTTP
        self.generate = GenerateServicer(self.ctx, self.frontend)
        self.server.add(
            generate_pb2_grpc.add_GenerateServiceServicer_to_server, self.generate, SERVICE_NAME
        )
        # RouterControl changes the cluster: on a private listener when control.port is set (the
        # public port then does not serve it at all), else on the public port behind the
        # cluster secret (auth.py)
        self.control: GrpcServer | None = None
        control_on = self.server
        if cfg.control.port is not None:
            control_cfg = cfg.server.model_copy(
                update={
                    "host": cfg.control.host,
                    "port": cfg.control.port,
                    "advertise_host": None,
                    "metrics_port": None,
                    "drain_announce_s": 0.0,
                }
            )
            self.control = control_on = GrpcServer(control_cfg, max_receive_bytes=receive)
        control_on.add(
            router_pb2_grpc.add_RouterControlServicer_to_server,
            RouterControlServicer(self.ctx, self.frontend.auth, private=self.control is not None),
            CONTROL_NAME,
        )
        self._health_tasks: set[asyncio.Task] = set()
        self._stopped = False
        self.http = None
        if cfg.http.port is not None:
            from splitserve.router.http_server import OpenAIServer

            self.http = OpenAIServer(
                self.ctx, self.frontend, ready=lambda: self.ready and not self._stopped
            )
            self.server.drain_hooks.append(self.http.drain)

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def ready(self) -> bool:
        has_prefill = self.cfg.routing.colocated or bool(self.registry.healthy(PREFILL))
        return has_prefill and bool(self.registry.healthy(DECODE))

    async def start(self) -> None:
        await self.server.start()
        if self.control is not None:
            await self.control.start()
            await self.control.set_serving(True)
        else:
            await self.server.health.set(CONTROL_NAME, SERVING)
        if self.http is not None:
            await self.http.start()
        self.registry.start()

    @property
    def control_address(self) -> str:
        """Where workers register: the control listener, else the public address."""
        return self.control.address if self.control is not None else self.address

    def _health_changed(self) -> None:
        task = asyncio.get_running_loop().create_task(self._set_health())
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _set_health(self) -> None:
        status = SERVING if self.ready and not self._stopped else NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.server.health.set(name, status)

    async def _shutdown(self) -> None:
        if self.control is not None and self.control.port is not None:
            await self.control.drain(1.0)
        await self.ctx.background.drain(self.cfg.worker_call_timeout_s)
        await self.registry.close()

    async def stop(self, grace_s: float | None = None) -> None:
        """Idempotent."""
        self._stopped = True
        await self.server.drain(grace_s)
        await self._shutdown()

    async def serve_until_signal(self) -> int:
        signum = await self.server.serve_until_signal()
        self._stopped = True
        await self._shutdown()
        return signum

    def describe(self) -> str:
        m = self.ctx.model
        r = self.cfg.routing
        metrics = (
            f", metrics on :{self.server.metrics_port}"
            if self.server.metrics_port is not None
            else ""
        )
        if self.http is not None:
            metrics += f", OpenAI HTTP API on {self.http.scheme}://{self.http.address}/v1"
        if self.control is not None:
            metrics += f", worker registration on {self.control.address}"
        auth = self.frontend.auth
        metrics += ", API keys required" if auth.keys_required else ", no API keys"
        prefill = (
            "colocated (no prefill workers)"
            if r.colocated
            else f"prefill {list(self.cfg.workers.prefill)} by {r.prefill_policy}"
        )
        return (
            f"router serving {SERVICE_NAME} on {self.address}: model {m.name} (vocab {m.vocab_size}, "
            f"max_model_len {m.max_model_len}), {prefill}, "
            f"decode {list(self.cfg.workers.decode)} by {r.decode_policy}{metrics}"
        )


async def run_router(cfg: RouterConfig) -> int:
    """Serves until SIGTERM/SIGINT, then drains; the CLI's entry point."""
    return await run_service(Router(cfg), "router", log)
