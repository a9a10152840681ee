"""A whole prefill worker process: gRPC server, model, engine, metrics, drain.

    start():  bind (health NOT_SERVING) -> load model (in a thread; health answers meanwhile)
              -> warm up -> health SERVING
    stop():   health NOT_SERVING, refuse new calls, in-flight ones get the grace period,
              then the engine stops (queued leftovers UNAVAILABLE, leases dropped)
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.engine.grpc_service import GrpcServer, run_service, service_name
from splitserve.engine.model_runner import ModelRunner
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.kvtransfer.server import KvTransferServer
from splitserve.prefill_worker.config import PrefillWorkerConfig
from splitserve.prefill_worker.engine import PrefillEngine
from splitserve.prefill_worker.kv_source import EngineLeaseSource
from splitserve.prefill_worker.metrics import PrefillMetrics
from splitserve.prefill_worker.servicer import PrefillWorkerServicer
from splitserve.protos import worker_pb2, worker_pb2_grpc

log = logging.getLogger("splitserve.prefill_worker")

SERVICE_NAME = service_name(worker_pb2.DESCRIPTOR, "PrefillWorker")


class PrefillWorker:
    def __init__(self, cfg: PrefillWorkerConfig, runner: ModelRunner | None = None) -> None:
        self.cfg = cfg
        self._runner = runner
        self.metrics = PrefillMetrics()
        self.server = GrpcServer(cfg.server, self.metrics.registry)
        self.servicer = PrefillWorkerServicer(cfg)
        self.server.add(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, self.servicer, SERVICE_NAME)
        self.engine: PrefillEngine | None = None
        self.kv_server: KvTransferServer | None = None
        self._health_task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        await self.server.start()
        runner = self._runner or await asyncio.to_thread(ModelRunner, self.cfg.engine)
        self.engine = PrefillEngine(self.cfg, runner, self.metrics, on_fatal=self._on_fatal)
        await self.engine.start()
        self.kv_server = KvTransferServer(runner.kv_cache, PoolSpec.of(runner.kv_cache, runner.compat_hash),
                                          EngineLeaseSource(self.engine), self.cfg.kv_transfer,
                                          metrics=KvTransferMetrics(self.metrics.registry))
        self.servicer.kv_port = await self.kv_server.start()
        self.servicer.engine = self.engine
        await self.server.set_serving(True)

    def _on_fatal(self, exc: BaseException) -> None:
        self._health_task = asyncio.get_running_loop().create_task(self.server.set_serving(False))

    async def _stop_engine(self) -> None:
        if self.kv_server is not None:
            await self.kv_server.close()
            self.kv_server = None
        if self.engine is not None:
            await self.engine.stop()

    async def stop(self, grace_s: float | None = None) -> None:
        await self.server.drain(grace_s)
        await self._stop_engine()

    async def serve_until_signal(self) -> int:
        signum = await self.server.serve_until_signal()
        await self._stop_engine()
        return signum

    def describe(self) -> str:
        r = self.engine.runner if self.engine else None
        what = (f"model {self.cfg.engine.model_path} ({r.device}, {str(r.dtype).removeprefix('torch.')}), "
                f"{r.num_blocks - 1} KV blocks x {r.block_size} tokens, max_model_len {r.max_model_len}") if r else ""
        metrics = f", metrics on :{self.server.metrics_port}" if self.server.metrics_port is not None else ""
        kv = f", KV over UCX on :{self.kv_server.port}" if self.kv_server is not None else ""
        return f"prefill worker serving {SERVICE_NAME} on {self.address}: {what}{kv}{metrics}"


async def run_worker(cfg: PrefillWorkerConfig) -> int:
    """Serves until SIGTERM/SIGINT, then drains; the CLI's entry point."""
    return await run_service(PrefillWorker(cfg), "prefill worker", log)
