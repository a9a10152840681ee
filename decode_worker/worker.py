"""A whole decode worker process: the worker skeleton (worker/worker_skeleton.py: gRPC, health,
stall watch, drain, TP ranks) around the decode engine loop and its KV puller.

    start_engine(): model (+ TP ranks), capture every decode graph (in a thread; health answers
                    meanwhile) -> engine loop -> UCX client (only now, after every graph was
                    captured: docs/architecture.md, "CUDA graphs")
    stop_engine():  KV puller (pooled endpoints aborted) -> engine loop (what is left gets
                    UNAVAILABLE) -> graphs released
    a failed engine: health NOT_SERVING before the failed requests' UNAVAILABLE reaches them
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.decode_worker.config import DecodeWorkerConfig
from splitserve.decode_worker.engine import DecodeEngine
from splitserve.decode_worker.engine_loop import EngineLoop
from splitserve.decode_worker.kv_pull import KvPuller
from splitserve.decode_worker.kv_stream_pull import StreamPuller
from splitserve.decode_worker.metrics import DecodeMetrics
from splitserve.decode_worker.rehearsal import rehearsal_sizes, rehearse
from splitserve.decode_worker.servicer import DecodeWorkerServicer
from splitserve.engine.model_runner import ModelRunner
from splitserve.kvtransfer.client import KvTransferClient
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.endpoint_pool import EndpointPool
from splitserve.kvtransfer.layer_stream_client import LayerStreamClient
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.kvtransfer.progress_wait import set_up_progress
from splitserve.protos import worker_pb2, worker_pb2_grpc
from splitserve.request.errors import RequestError
from splitserve.request.tokenizer import Tokenizer
from splitserve.service.grpc_service import run_service, service_name
from splitserve.worker.worker_skeleton import WorkerSkeleton

log = logging.getLogger("splitserve.decode_worker")

SERVICE_NAME = service_name(worker_pb2.DESCRIPTOR, "DecodeWorker")


def _load_tokenizer(model_path: str):
    try:
        return Tokenizer.from_dir(model_path)
    except FileNotFoundError:
        log.warning(
            "no tokenizer.json in %s: requests with stop strings will be refused", model_path
        )
        return None


class DecodeWorker(WorkerSkeleton):
    role = "decode"
    service_name = SERVICE_NAME

    def __init__(self, cfg: DecodeWorkerConfig, runner: ModelRunner | None = None) -> None:
        self.metrics = DecodeMetrics()
        super().__init__(
            cfg,
            self.metrics.registry,
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
            DecodeWorkerServicer(),
        )
        self._runner = runner
        self.engine: DecodeEngine | None = None
        self.loop: EngineLoop | None = None
        self.rehearsal_sizes: list[int] = []  # the start-up rehearsal's prompt lengths

    def _build(self) -> DecodeEngine:
        from splitserve.decode_worker.tp_follower import decode_follower_main

        runner = self._runner or self.start_ranks(decode_follower_main)
        engine = DecodeEngine(
            self.cfg, runner, _load_tokenizer(self.cfg.engine.model_path), self.metrics
        )
        self.rehearsal_sizes = rehearsal_sizes(engine)  # the pool is zeroed after it, if any
        engine.warm_up(zero=not self.rehearsal_sizes)
        return engine

    async def start_engine(self) -> None:
        self.engine = await asyncio.to_thread(self._build)
        aio = asyncio.get_running_loop()
        # health goes NOT_SERVING before the failed requests' UNAVAILABLE reaches their callers
        self.loop = EngineLoop(
            self.engine,
            on_fatal=lambda exc: aio.call_soon_threadsafe(
                asyncio.ensure_future, self.server.set_serving(False)
            ),
        )
        self.loop.start()
        graphs = self.engine.runner.prefill_graphs
        if graphs is not None:  # its dense attention's plans where local prefills run
            await asyncio.wrap_future(self.loop.call(graphs.prepare_dense_here))
        await rehearse(self.loop, self.engine, self.rehearsal_sizes)  # before any user request
        self.servicer.loop = self.loop
        runner = self.engine.runner
        kv_metrics = KvTransferMetrics(self.metrics.registry)
        install = None
        if runner.tp.enabled:  # rank 0 pulls every head and spreads them over the ranks
            from splitserve.decode_worker.tp_follower import TPKvInstaller

            install = TPKvInstaller(self.loop, runner)
            self.watch_ranks()
        spec = PoolSpec.of(
            runner.kv_cache, runner.compat_hash, runner.model_config.num_key_value_heads
        )
        client = KvTransferClient(
            runner.kv_cache, spec, self.cfg.kv_transfer, kv_metrics, install=install
        )
        self.servicer.puller = KvPuller(
            client, self.cfg.kv_transfer.failure_policy, self.cfg.faults
        )
        if self.cfg.kv_transfer.streaming:  # TP: rank 0 streams every shard, `install` spreads it
            # endpoints of their own: a stream holds one for a whole prefill, so pulls (a
            # stream's fallback among them) must not queue behind streams for the per-peer cap
            self._stream_pool = EndpointPool(self.cfg.kv_transfer.connect_timeout_s)
            stream_client = LayerStreamClient(
                runner.kv_cache,
                spec,
                self.cfg.kv_transfer,
                self._stream_pool,
                kv_metrics,
                install=install,
            )
            self.servicer.streamer = StreamPuller(
                stream_client,
                self.cfg.kv_transfer.stream_reserve_wait_s,
                self.engine.metrics,
                self.cfg.faults,
            )
        kv_metrics.log_transports()
        set_up_progress(self.cfg.kv_transfer, runner.device.type)  # before any pull

    async def stop_engine(self) -> None:
        if self.servicer.puller is not None:
            self.servicer.puller.close()
            self.servicer.puller = None
        if getattr(self, "_stream_pool", None) is not None:
            self._stream_pool.close()
            self._stream_pool = None
        if self.loop is not None:
            await asyncio.to_thread(self.loop.stop)
        elif self.engine is not None:
            self.engine.close()

    def engine_busy(self) -> bool:
        return self.loop is not None and self.loop.busy

    def engine_progress(self) -> int:
        return self.loop.progress if self.loop is not None else 0

    def engine_failed(self) -> bool:
        return self.loop is not None and not self.loop.alive

    def fail_in_flight(self, rank: int, code) -> None:
        self.servicer.fail_all(
            RequestError.unavailable(
                f"the decode worker lost tensor-parallel rank {rank} (exit {code}); retry on another decode worker"
            )
        )

    def describe(self) -> str:
        e = self.engine
        if e is None:
            return f"decode worker on {self.address} (not started)"
        r = e.runner
        graphs = e.graphs.captured_sizes
        metrics = (
            f", metrics on :{self.server.metrics_port}"
            if self.server.metrics_port is not None
            else ""
        )
        return (
            f"decode worker serving {SERVICE_NAME} on {self.address}: model {self.cfg.engine.model_path} "
            f"({r.device}, {str(r.dtype).removeprefix('torch.')}), {e.allocator.num_usable} KV blocks x "
            f"{r.block_size} tokens, max batch {e.max_batch_size}, "
            f"CUDA graphs {graphs if graphs else 'off'}"
            f"{f', tensor parallel {r.tp.size}' if r.tp.enabled else ''}{metrics}"
            f"{self.startup_note()}"
        )


async def run_worker(cfg: DecodeWorkerConfig) -> int:
    """Serves until SIGTERM/SIGINT, then drains; the CLI's entry point."""
    return await run_service(DecodeWorker(cfg), "decode worker", log)
