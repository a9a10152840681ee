"""A whole prefill worker process: the worker skeleton (worker/worker_skeleton.py: gRPC, health,
stall watch, drain, TP ranks) around the prefill engine and its UCX listener.

    start_engine(): model (+ TP ranks) -> engine warm-up -> UCX listener
    stop_engine():  UCX listener (endpoints aborted, handlers awaited) -> engine (queued
                    leftovers UNAVAILABLE, leases dropped)

With engine.parallel.tensor_parallel_size N > 1 this process is rank 0: it spawns ranks
1..N-1 (tp_follower.py), which run every forward on their slices and serve their KV heads
over UCX listeners of their own (a fixed kv_transfer.listen_port p: rank r listens on p + r);
handles carry the shard map (KvHandle.shards), and each rank streams its own heads
(prefill_worker/kv_stream_tp.py). A follower that dies fails the in-flight requests
(UNAVAILABLE), health goes NOT_SERVING and the process exits 1 (worker/tp_lifecycle.py).
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.engine.model_runner import ModelRunner
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.kvtransfer.server import KvTransferServer
from splitserve.prefill_worker.config import PrefillWorkerConfig
from splitserve.prefill_worker.engine import PrefillEngine
from splitserve.prefill_worker.kv_source import EngineLeaseSource
from splitserve.prefill_worker.kv_stream import attach_stream_hub
from splitserve.prefill_worker.kv_stream_tp import MirroredStreamHub
from splitserve.prefill_worker.metrics import PrefillMetrics
from splitserve.prefill_worker.servicer import PrefillWorkerServicer
from splitserve.prefill_worker.tp_follower import (
    MirroredLeaseTable,
    exchange_ports,
    prefill_follower_main,
)
from splitserve.protos import worker_pb2, worker_pb2_grpc
from splitserve.service.grpc_service import run_service, service_name
from splitserve.worker.worker_skeleton import WorkerSkeleton

log = logging.getLogger("splitserve.prefill_worker")

SERVICE_NAME = service_name(worker_pb2.DESCRIPTOR, "PrefillWorker")


class PrefillWorker(WorkerSkeleton):
    role = "prefill"
    service_name = SERVICE_NAME

    def __init__(self, cfg: PrefillWorkerConfig, runner: ModelRunner | None = None) -> None:
        self.metrics = PrefillMetrics()
        super().__init__(
            cfg,
            self.metrics.registry,
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
            PrefillWorkerServicer(cfg),
        )
        self._runner = runner
        self.engine: PrefillEngine | None = None
        self.kv_server: KvTransferServer | None = None
        self._health_task: asyncio.Task | None = None
        self._follower_ports: list[int] = []

    def _runner_and_ranks(self) -> ModelRunner:
        runner = self.start_ranks(prefill_follower_main)
        if runner.tp.enabled:  # before any command: the control group carries one thing at a time
            self._follower_ports = exchange_ports(runner.tp, 0)[1:]
        return runner

    async def start_engine(self) -> None:
        runner = self._runner or await asyncio.to_thread(self._runner_and_ranks)
        self.engine = PrefillEngine(self.cfg, runner, self.metrics, on_fatal=self._on_fatal)
        if runner.tp.enabled:
            self.engine.leases = MirroredLeaseTable(runner.mirror)
            self.watch_ranks()
        # the rehearsal comes last: through the worker's own path (the layer hook of the
        # streamed hand-over, the KV listener's lease wake-ups), as a user's first prompt
        await self.engine.start(rehearse_now=False)
        spec = PoolSpec.of(
            runner.kv_cache, runner.compat_hash, runner.model_config.num_key_value_heads
        )
        self.kv_server = KvTransferServer(
            runner.kv_cache,
            spec,
            EngineLeaseSource(self.engine),
            self.cfg.kv_transfer,
            faults=self.cfg.faults.transfer,
            metrics=KvTransferMetrics(self.metrics.registry),
            host=self.cfg.server.host,  # a loopback worker's KV port stays on loopback too
            drain_strays=True,  # this process's UCX serves the listener only
        )
        if self.cfg.kv_transfer.streaming:  # TP: every rank streams its heads (kv_stream_tp.py)
            extra = (
                {"hub_cls": MirroredStreamHub, "publish": runner.mirror}
                if runner.tp.enabled
                else {}
            )
            attach_stream_hub(self.engine, self.kv_server, self.cfg.kv_transfer, spec, **extra)
            self.servicer.kv_streaming = True
        self.servicer.kv_port = await self.kv_server.start()
        self.engine.leases.on_grant = self.kv_server.expect_pull  # wakes idle KV endpoints
        if runner.tp.enabled:
            self.servicer.shard_ports = [self.servicer.kv_port, *self._follower_ports]
        await self.engine.rehearse()
        self.servicer.engine = self.engine

    async def stop_engine(self) -> None:
        if self.kv_server is not None:
            await self.kv_server.close()
            self.kv_server = None
        if self.engine is not None:
            await self.engine.stop()

    def engine_busy(self) -> bool:
        return self.engine is not None and self.engine.busy

    def engine_progress(self) -> int:
        return self.engine.progress if self.engine is not None else 0

    def engine_failed(self) -> bool:
        return self.engine is not None and self.engine.fatal is not None

    def fail_in_flight(self, rank: int, code) -> None:
        """The engine fails now: the step in flight may wait on the dead rank forever."""
        self.engine.fail(RuntimeError(f"tensor-parallel rank {rank} exited with {code}"))

    def _on_fatal(self, exc: BaseException) -> None:
        log.error("prefill worker stops serving: %s", exc)
        self._health_task = asyncio.get_running_loop().create_task(self.server.set_serving(False))

    def describe(self) -> str:
        r = self.engine.runner if self.engine else None
        what = (
            (
                f"model {self.cfg.engine.model_path} ({r.device}, {str(r.dtype).removeprefix('torch.')}), "
                f"{r.num_blocks - 1} KV blocks x {r.block_size} tokens, max_model_len {r.max_model_len}"
            )
            if r
            else ""
        )
        metrics = (
            f", metrics on :{self.server.metrics_port}"
            if self.server.metrics_port is not None
            else ""
        )
        kv = f", KV over UCX on :{self.kv_server.port}" if self.kv_server is not None else ""
        if r is not None and r.tp.enabled:
            kv += f", tensor parallel {r.tp.size} (rank UCX ports {self.servicer.shard_ports})"
        return f"prefill worker serving {SERVICE_NAME} on {self.address}: {what}{kv}{metrics}{self.startup_note()}"


async def run_worker(cfg: PrefillWorkerConfig) -> int:
    """Serves until SIGTERM/SIGINT, then drains; the CLI's entry point."""
    return await run_service(PrefillWorker(cfg), "prefill worker", log)
