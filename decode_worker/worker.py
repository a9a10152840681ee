"""A whole decode worker process: gRPC server, model, graphs, engine loop, metrics, drain.

    start():  bind (health NOT_SERVING) -> load the model and capture every decode graph (in a
              thread; health answers meanwhile; before any UCX listener exists, see DESIGN
              "CUDA graphs") -> engine loop -> health SERVING
    watch:    health NOT_SERVING when the engine fails (for good) or makes no progress with work
              queued for engine.stall_timeout_s (until it moves again): engine/stall_watch.py
    rank lost (tensor parallel): NOT_SERVING, in-flight requests UNAVAILABLE, exit 1
    stop():   health NOT_SERVING, refuse new calls, in-flight streams get the grace period
              (then they are cancelled: their requests are aborted), the engine loop ends,
              the graphs are released
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.decode_worker.config import DecodeWorkerConfig
from splitserve.decode_worker.engine import DecodeEngine
from splitserve.decode_worker.engine_loop import EngineLoop
from splitserve.decode_worker.kv_pull import KvPuller
from splitserve.decode_worker.metrics import DecodeMetrics
from splitserve.decode_worker.servicer import DecodeWorkerServicer
from splitserve.engine.grpc_service import GrpcServer, run_service, service_name
from splitserve.engine.errors import RequestError
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.stall_watch import StallWatch
from splitserve.engine.tokenizer import Tokenizer
from splitserve.engine.tp_lifecycle import exit_after_rank_loss, serve_until_lost
from splitserve.kvtransfer.client import KvTransferClient
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.protos import worker_pb2, worker_pb2_grpc

log = logging.getLogger("splitserve.decode_worker")

SERVICE_NAME = service_name(worker_pb2.DESCRIPTOR, "DecodeWorker")


def _load_tokenizer(model_path: str):
    try:
        return Tokenizer.from_dir(model_path)
    except FileNotFoundError:
        log.warning("no tokenizer.json in %s: requests with stop strings will be refused", model_path)
        return None


class DecodeWorker:
    def __init__(self, cfg: DecodeWorkerConfig, runner: ModelRunner | None = None) -> None:
        self.cfg = cfg
        self._runner = runner
        self.metrics = DecodeMetrics()
        self.server = GrpcServer(cfg.server, self.metrics.registry)
        self.servicer = DecodeWorkerServicer()
        self.server.add(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, self.servicer, SERVICE_NAME)
        self.engine: DecodeEngine | None = None
        self.loop: EngineLoop | None = None
        self.watch: StallWatch | None = None
        self.ranks = None  # tp_control.RankSet when this process spawned the runner's ranks
        self._lost = asyncio.Event()  # a tensor-parallel rank died: serve_until_signal exits the process

    @property
    def address(self) -> str:
        return self.server.address

    def _start_ranks(self) -> ModelRunner:
        from splitserve.decode_worker.tp_follower import decode_follower_main
        from splitserve.engine.tp_control import start_ranks

        self.ranks = start_ranks(self.cfg.engine, decode_follower_main, self.cfg)
        return self.ranks.runner

    def _build(self) -> DecodeEngine:
        runner = self._runner or self._start_ranks()
        engine = DecodeEngine(self.cfg, runner, _load_tokenizer(self.cfg.engine.model_path), self.metrics)
        engine.warm_up()
        return engine

    async def start(self) -> None:
        await self.server.start()
        self.engine = await asyncio.to_thread(self._build)
        aio = asyncio.get_running_loop()
        # health goes NOT_SERVING before the failed requests' UNAVAILABLE reaches their callers
        self.loop = EngineLoop(self.engine, on_fatal=lambda exc: aio.call_soon_threadsafe(
            asyncio.ensure_future, self.server.set_serving(False)))
        self.loop.start()
        self.servicer.loop = self.loop
        # UCX starts only now, after every graph was captured (DESIGN.md "CUDA graphs").
        runner = self.engine.runner
        kv_metrics = KvTransferMetrics(self.metrics.registry)
        install = None
        if runner.tp.enabled:  # rank 0 pulls every head and spreads them over the ranks
            from splitserve.decode_worker.tp_follower import TPKvInstaller

            install = TPKvInstaller(self.loop, runner)
            if self.ranks is not None:
                self.ranks.watch(lambda rank, code: aio.call_soon_threadsafe(self._rank_died, rank, code))
        spec = PoolSpec.of(runner.kv_cache, runner.compat_hash, runner.model_config.num_key_value_heads)
        client = KvTransferClient(runner.kv_cache, spec, self.cfg.kv_transfer, kv_metrics, install=install)
        self.servicer.puller = KvPuller(client, self.cfg.kv_transfer.failure_policy, self.cfg.faults)
        kv_metrics.log_transports()
        await self.server.set_serving(True)
        loop = self.loop
        self.watch = StallWatch("decode", lambda: loop.busy, lambda: loop.progress, lambda: not loop.alive,
                                self.cfg.engine.stall_timeout_s, self.server.set_serving)
        self.watch.start()

    def _rank_died(self, rank: int, code) -> None:
        """A follower is gone: no step can finish any more (a collective would wait on it)."""
        log.error("tensor-parallel rank %d exited with %s; health NOT_SERVING, in-flight requests UNAVAILABLE, "
                  "the worker exits", rank, code)
        asyncio.ensure_future(self.server.set_serving(False))
        self.servicer.fail_all(RequestError.unavailable(
            f"the decode worker lost tensor-parallel rank {rank} (exit {code}); retry on another decode worker"))
        self._lost.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """Idempotent."""
        if self.watch is not None:
            await self.watch.stop()
            self.watch = None
        await self.server.drain(grace_s)
        if self.servicer.puller is not None:
            self.servicer.puller.close()
            self.servicer.puller = None
        if self.loop is not None:
            await asyncio.to_thread(self.loop.stop)
        elif self.engine is not None:
            self.engine.close()
        if self.ranks is not None:  # after the loop: its last commands reach the followers first
            await asyncio.to_thread(self.ranks.close)
            self.ranks = None

    async def serve_until_signal(self) -> int:
        signum = await serve_until_lost(self.server, self._lost)
        if self._lost.is_set():
            exit_after_rank_loss(self.ranks, log)
        await self.stop(0)
        return signum

    def describe(self) -> str:
        e = self.engine
        if e is None:
            return f"decode worker on {self.address} (not started)"
        r = e.runner
        graphs = e.graphs.captured_sizes
        metrics = f", metrics on :{self.server.metrics_port}" if self.server.metrics_port is not None else ""
        return (f"decode worker serving {SERVICE_NAME} on {self.address}: model {self.cfg.engine.model_path} "
                f"({r.device}, {str(r.dtype).removeprefix('torch.')}), {e.allocator.num_usable} KV blocks x "
                f"{r.block_size} tokens, max batch {e.max_batch_size}, "
                f"CUDA graphs {graphs if graphs else 'off'}"
                f"{f', tensor parallel {r.tp.size}' if r.tp.enabled else ''}{metrics}")


async def run_worker(cfg: DecodeWorkerConfig) -> int:
    """Serves until SIGTERM/SIGINT, then drains; the CLI's entry point."""
    return await run_service(DecodeWorker(cfg), "decode worker", log)
