"""A whole prefill worker process: gRPC server, model, engine, metrics, drain.

    start():  bind (health NOT_SERVING) -> load model (in a thread; health answers meanwhile)
              -> warm up -> health SERVING
    watch:    health NOT_SERVING when the engine fails (for good) or makes no progress with work
              queued for engine.stall_timeout_s (until it moves again): engine/stall_watch.py
    stop():   health NOT_SERVING, refuse new calls, in-flight ones get the grace period,
              then the engine stops (queued leftovers UNAVAILABLE, leases dropped)

With engine.parallel.tensor_parallel_size N > 1 this process is rank 0: it spawns ranks
1..N-1 (tp_follower.py), which run every forward on their slices and serve their KV heads
over UCX listeners of their own (a fixed kv_transfer.listen_port p: rank r listens on p + r);
handles carry the shard map (KvHandle.shards). A follower that dies fails the in-flight requests
(UNAVAILABLE), health goes NOT_SERVING and the process exits 1 (engine/tp_lifecycle.py).
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.engine.grpc_service import GrpcServer, run_service, service_name
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.stall_watch import StallWatch
from splitserve.engine.tp_lifecycle import exit_after_rank_loss, serve_until_lost
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.kvtransfer.server import KvTransferServer
from splitserve.prefill_worker.config import PrefillWorkerConfig
from splitserve.prefill_worker.engine import PrefillEngine
from splitserve.prefill_worker.kv_source import EngineLeaseSource
from splitserve.prefill_worker.metrics import PrefillMetrics
from splitserve.prefill_worker.servicer import PrefillWorkerServicer
from splitserve.prefill_worker.tp_follower import MirroredLeaseTable, exchange_ports, prefill_follower_main
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
        self.watch: StallWatch | None = None
        self.ranks = None  # tp_control.RankSet when this process spawned the runner's ranks
        self._follower_ports: list[int] = []
        self._lost = asyncio.Event()  # a tensor-parallel rank died: serve_until_signal exits the process

    def _start_ranks(self):
        from splitserve.engine.tp_control import start_ranks

        self.ranks = start_ranks(self.cfg.engine, prefill_follower_main, self.cfg)
        runner = self.ranks.runner
        if runner.tp.enabled:  # before any command: the control group carries one thing at a time
            self._follower_ports = exchange_ports(runner.tp, 0)[1:]
        return runner

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        await self.server.start()
        runner = self._runner or await asyncio.to_thread(self._start_ranks)
        self.engine = PrefillEngine(self.cfg, runner, self.metrics, on_fatal=self._on_fatal)
        if runner.tp.enabled:
            self.engine.leases = MirroredLeaseTable(runner.mirror)
            if self.ranks is not None:
                aio = asyncio.get_running_loop()
                self.ranks.watch(lambda rank, code: aio.call_soon_threadsafe(self._rank_died, rank, code))
        await self.engine.start()
        spec = PoolSpec.of(runner.kv_cache, runner.compat_hash, runner.model_config.num_key_value_heads)
        self.kv_server = KvTransferServer(runner.kv_cache, spec, EngineLeaseSource(self.engine), self.cfg.kv_transfer,
                                          faults=self.cfg.faults.transfer,
                                          metrics=KvTransferMetrics(self.metrics.registry))
        self.servicer.kv_port = await self.kv_server.start()
        if runner.tp.enabled:
            self.servicer.shard_ports = [self.servicer.kv_port, *self._follower_ports]
        self.servicer.engine = self.engine
        await self.server.set_serving(True)
        engine = self.engine
        self.watch = StallWatch("prefill", lambda: engine.busy, lambda: engine.progress,
                                lambda: engine.fatal is not None, self.cfg.engine.stall_timeout_s,
                                self.server.set_serving)
        self.watch.start()

    def _rank_died(self, rank: int, code) -> None:
        """A follower is gone: the engine fails now (its step may wait on the dead rank forever)."""
        self.engine.fail(RuntimeError(f"tensor-parallel rank {rank} exited with {code}"))
        self._lost.set()

    def _on_fatal(self, exc: BaseException) -> None:
        log.error("prefill worker stops serving: %s", exc)
        self._health_task = asyncio.get_running_loop().create_task(self.server.set_serving(False))

    async def _stop_engine(self) -> None:
        if self.watch is not None:
            await self.watch.stop()
            self.watch = None
        if self.kv_server is not None:
            await self.kv_server.close()
            self.kv_server = None
        if self.engine is not None:
            await self.engine.stop()
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.close)
            self.ranks = None

    async def stop(self, grace_s: float | None = None) -> None:
        await self.server.drain(grace_s)
        await self._stop_engine()

    async def serve_until_signal(self) -> int:
        signum = await serve_until_lost(self.server, self._lost)
        if self._lost.is_set():
            exit_after_rank_loss(self.ranks, log)
        await self._stop_engine()
        return signum

    def describe(self) -> str:
        r = self.engine.runner if self.engine else None
        what = (f"model {self.cfg.engine.model_path} ({r.device}, {str(r.dtype).removeprefix('torch.')}), "
                f"{r.num_blocks - 1} KV blocks x {r.block_size} tokens, max_model_len {r.max_model_len}") if r else ""
        metrics = f", metrics on :{self.server.metrics_port}" if self.server.metrics_port is not None else ""
        kv = f", KV over UCX on :{self.kv_server.port}" if self.kv_server is not None else ""
        if r is not None and r.tp.enabled:
            kv += f", tensor parallel {r.tp.size} (rank UCX ports {self.servicer.shard_ports})"
        return f"prefill worker serving {SERVICE_NAME} on {self.address}: {what}{kv}{metrics}"


async def run_worker(cfg: PrefillWorkerConfig) -> int:
    """Serves until SIGTERM/SIGINT, then drains; the CLI's entry point."""
    return await run_service(PrefillWorker(cfg), "prefill worker", log)
