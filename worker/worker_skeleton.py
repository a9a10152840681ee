"""What every worker process does around its engine, written once (prefill and decode workers
add only their engine, servicer and KV side).

    start():  gRPC bound (health NOT_SERVING; health answers from here on)
              -> start_engine(): model load + warm-up (+ tensor-parallel ranks), KV transfer
              -> the start-up heap frozen (worker/gc_pauses.py)
              -> health SERVING -> the stall watch (worker/stall_watch.py); the start-up time
              and warm-up's kernel compilations go into the SERVING log line (startup_note)
    rank lost (tensor parallel): fail_in_flight(), then NOT_SERVING, exit 1 (tp_lifecycle.py)
    stop():   the stall watch ends -> drain (health NOT_SERVING for good, in-flight calls get
              the grace) -> stop_engine() (UCX first, then the engine) -> ranks closed;
              the process then exits without GC (service_process.py)

A subclass sets `role`, `service_name` and implements start_engine / stop_engine /
engine_busy / engine_progress / engine_failed / fail_in_flight / describe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from splitserve.service.cluster_auth import RequireClusterSecret
from splitserve.service.credentials import cluster_secret, is_loopback_host
from splitserve.service.grpc_service import GrpcServer
from splitserve.worker.gc_pauses import GcPauseCollector, freeze_startup_heap, unfreeze_heap
from splitserve.worker.kernel_metrics import KernelCompileMetrics
from splitserve.worker.stall_watch import StallWatch
from splitserve.worker.tp_lifecycle import exit_after_rank_loss, serve_until_lost

log = logging.getLogger(__name__)


class WorkerSkeleton:
    role = "worker"
    service_name = ""

    def __init__(self, cfg, registry, add_servicer: Callable, servicer) -> None:
        self.cfg = cfg
        # with a cluster secret, only its holders (the router) may call this worker
        secret = cluster_secret()
        if secret is None and not is_loopback_host(cfg.server.host) and not cfg.server.open_to_all:
            raise ValueError(
                f"this worker listens on {cfg.server.host} (beyond this machine) without a cluster "
                "secret, so anyone who reaches it could run requests; set SPLITSERVE_CLUSTER_SECRET "
                "(or _FILE) here and on the router, or --open-to-all (server.open_to_all)"
            )
        guard = [RequireClusterSecret(secret)] if secret else []
        self.server = GrpcServer(cfg.server, registry, guard)
        # before any kernel runs: warm-up's compilations count as start-up, later ones as serving
        self.kernel_compiles = KernelCompileMetrics(registry)
        self.registry = registry
        self.gc_pauses: GcPauseCollector | None = None  # from SERVING on (gc_pauses.py)
        self.frozen_objects = 0  # the start-up heap, out of the collector's way
        self._froze = False
        self.startup_s: float | None = None
        self.servicer = servicer
        self.server.add(add_servicer, servicer, self.service_name)
        self.ranks = None  # tp_control.RankSet when this process spawned the runner's ranks
        self.watch: StallWatch | None = None
        self._lost = (
            asyncio.Event()
        )  # a tensor-parallel rank died: serve_until_signal exits the process

    @property
    def address(self) -> str:
        return self.server.address

    # ---- the parts a worker supplies --------------------------------------------------------
    async def start_engine(self) -> None:
        raise NotImplementedError

    async def stop_engine(self) -> None:
        raise NotImplementedError

    def engine_busy(self) -> bool:
        raise NotImplementedError

    def engine_progress(self) -> int:
        raise NotImplementedError

    def engine_failed(self) -> bool:
        raise NotImplementedError

    def fail_in_flight(self, rank: int, code) -> None:
        """A tensor-parallel follower died: end every in-flight call (UNAVAILABLE)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    # ---- tensor-parallel ranks ---------------------------------------------------------------
    def start_ranks(self, follower_main: Callable):
        """This worker's runner (rank 0) with followers 1..N-1 spawned (just a runner at TP 1)."""
        from splitserve.engine.tp_control import start_ranks

        self.ranks = start_ranks(self.cfg.engine, follower_main, self.cfg)
        return self.ranks.runner

    def watch_ranks(self) -> None:
        """Once serving can begin: a follower's death fails the worker (called on the event loop)."""
        if self.ranks is not None:
            aio = asyncio.get_running_loop()
            self.ranks.watch(
                lambda rank, code: aio.call_soon_threadsafe(self._rank_died, rank, code)
            )

    def _rank_died(self, rank: int, code) -> None:
        log.error(
            "tensor-parallel rank %d exited with %s; health NOT_SERVING, in-flight requests UNAVAILABLE, "
            "the %s worker exits",
            rank,
            code,
            self.role,
        )
        asyncio.ensure_future(self.server.set_serving(False))
        self.fail_in_flight(rank, code)
        self._lost.set()

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        began = time.perf_counter()
        await self.server.start()
        await self.start_engine()
        self.kernel_compiles.mark_serving()
        # the first full collection would otherwise land on a request (worker/gc_pauses.py)
        self.frozen_objects, _ = freeze_startup_heap()
        self._froze = self.frozen_objects > 0
        if self.gc_pauses is None:
            self.gc_pauses = GcPauseCollector(self.registry)
        self.startup_s = time.perf_counter() - began
        await self.server.set_serving(True)
        self.watch = StallWatch(
            self.role,
            self.engine_busy,
            self.engine_progress,
            self.engine_failed,
            self.cfg.engine.stall_timeout_s,
            self.server.set_serving,
        )
        self.watch.start()

    def startup_note(self) -> str:
        """For the SERVING log line: how long start-up took and what warm-up compiled."""
        if self.startup_s is None:
            return ""
        return (
            f", started in {self.startup_s:.1f} s "
            f"({self.kernel_compiles.startup()} kernel compilations during warm-up; "
            f"{self.frozen_objects} start-up objects frozen out of the garbage collector)"
        )

    async def stop(self, grace_s: float | None = None) -> None:
        """In a fixed order; idempotent."""
        if self.watch is not None:
            await self.watch.stop()
            self.watch = None
        await self.server.drain(grace_s)
        self.kernel_compiles.mark_stopped()
        try:
            await self.stop_engine()
        finally:
            self._release_heap()
        if self.ranks is not None:  # after the engine: its last commands reach the followers first
            await asyncio.to_thread(self.ranks.close)
            self.ranks = None

    def _release_heap(self) -> None:
        """A worker run in-process (tests, benchmarks) leaves a collectable heap behind."""
        if self.gc_pauses is not None:
            self.gc_pauses.close()
        if self._froze:
            self._froze = False
            unfreeze_heap()

    async def serve_until_signal(self) -> int:
        signum = await serve_until_lost(self.server, self._lost)
        if self._lost.is_set():
            exit_after_rank_loss(self.ranks, log)
        await self.stop(0)
        return signum
