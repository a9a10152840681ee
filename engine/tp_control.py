"""How rank 0 of a tensor-parallel worker drives its followers: spawn, publish, follow.

    rank 0 (gRPC, scheduler, sampler)                    follower rank r (no server)
    ─────────────────────────────────                    ───────────────────────────
    spawn_followers() ── mp "spawn" ───────────────────▶ follower entry: init_tp, build runner
    runner.mirror = publisher.publish                     loop: cmd = receive(tp)
      runner.prefill(chunks) ─▶ ("prefill", chunks) ─┐          ("prefill", chunks)  -> runner.prefill
      runner.zero_kv()       ─▶ ("zero_kv",)        ├─gloo─▶   ("zero_kv",)         -> runner.zero_kv
      graph runner / leases  ─▶ (their commands)    │          other commands       -> handlers[name]
      close()                ─▶ ("stop",)          ─┘          ("stop",)            -> return

Commands travel in publish order over the gloo `cpu_group` (broadcast_object_list) from one
sender thread, so rank 0's callers never wait for a follower; every rank therefore issues the
model's collectives (device_group) in the same order. Followers die with rank 0: a parent
watchdog (the parent pid changes) and a dead control connection both end them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping

import torch.distributed as dist

from splitserve.engine.parallel import TPGroup

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_followers(size: int, target: Callable, *args) -> tuple[str, list[mp.Process]]:
    """Starts ranks 1..size-1 as `target(rank, size, init_method, *args)` (picklable args);
    returns the rendezvous address rank 0 joins with `init_tp(0, ...)`."""
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, size):
        p = ctx.Process(target=target, args=(rank, size, init_method, *args), daemon=True,
                        name=f"splitserve-tp-rank{rank}")
        p.start()
        procs.append(p)
    return init_method, procs


def die_with_parent() -> None:
    """A follower ends when rank 0 (its parent) ends, however it ends."""
    # No PR_SET_PDEATHSIG: it fires when the parent *thread* that spawned us ends, and rank 0
    # spawns from a worker thread. The parent's pid going away is what counts.
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def watch_followers(procs: list[mp.Process], on_death: Callable[[int], None]) -> threading.Thread:
    """Rank 0: `on_death(exitcode)` once, the first time a follower is found dead."""
    def watch() -> None:
        while True:
            for p in procs:
                if not p.is_alive():
                    on_death(p.exitcode)
                    return
            time.sleep(0.5)

    t = threading.Thread(target=watch, name="tp-follower-watch", daemon=True)
    t.start()
    return t


class ControlPublisher:
    """Rank 0's end of the command stream: `publish` queues, one thread broadcasts in order."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.failed: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tp-publish", daemon=True)
        self._thread.start()

    def publish(self, cmd: tuple) -> None:
        if self.failed is not None:
            raise RuntimeError(f"tensor-parallel followers are gone ({self.failed!r}); the worker stops serving")
        self._queue.put(cmd)

    def _run(self) -> None:
        while True:
            cmd = self._queue.get()
            try:
                dist.broadcast_object_list([cmd], src=0, group=self.tp.cpu_group)
            except Exception as exc:  # a follower died: the next collective fails on rank 0 as well
                log.error("tensor-parallel control stream broken: %r", exc)
                self.failed = exc
                return
            if cmd[0] == "stop":
                return

    def close(self, timeout: float = 30.0) -> None:
        """Tells the followers to stop (after every queued command); idempotent."""
        if self._thread.is_alive() and self.failed is None:
            self._queue.put(("stop",))
            self._thread.join(timeout)


def receive(tp: TPGroup) -> tuple:
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]


def follow(tp: TPGroup, runner, handlers: Mapping[str, Callable] | None = None) -> None:
    """A follower's loop: runs rank 0's commands on its own runner until ("stop",)."""
    if runner.device.type == "cuda":  # this thread launches on the rank's GPU (Triton, graphs)
        import torch

        torch.cuda.set_device(runner.device)
    handlers = dict(handlers or {})
    handlers.setdefault("prefill", lambda chunks: runner.prefill(chunks))
    handlers.setdefault("decode", lambda lanes: runner.decode(lanes))
    handlers.setdefault("zero_kv", lambda: runner.zero_kv())
    while True:
        cmd = receive(tp)
        if cmd[0] == "stop":
            return
        handlers[cmd[0]](*cmd[1:])


def join_as_follower(rank: int, size: int, init_method: str, engine_cfg) -> TPGroup:
    """A follower process's start: tied to rank 0's life, logging tagged with its rank, on its
    own device (cuda:rank), joined to the TP group."""
    from splitserve.engine.model_runner import resolve_device
    from splitserve.engine.parallel import init_tp, rank_device

    die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    device = rank_device(resolve_device(engine_cfg.device), rank)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    return init_tp(rank, size, init_method, device)


def runner_follower_main(rank: int, size: int, init_method: str, engine_cfg) -> None:
    """Follower of a bare ModelRunner driven by rank 0 (OfflineEngine, tests)."""
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.parallel import destroy_tp

    tp = join_as_follower(rank, size, init_method, engine_cfg)
    try:
        follow(tp, ModelRunner(engine_cfg, tp))
    finally:
        destroy_tp(tp)


class RankSet:
    """Rank 0's view of its worker's ranks: the runner (rank 0's), the publisher, the followers."""

    def __init__(self, runner, publisher: ControlPublisher | None = None, procs: list[mp.Process] | None = None):
        self.runner, self.publisher, self.procs = runner, publisher, procs or []

    def close(self, timeout: float = 30.0) -> None:
        """Stops the followers (after the commands already published) and leaves the group;
        idempotent."""
        from splitserve.engine.parallel import destroy_tp

        if self.publisher is not None:
            self.publisher.close(timeout)
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(5)
        destroy_tp(self.runner.tp)


def start_ranks(engine_cfg, follower: Callable = runner_follower_main, *follower_args) -> RankSet:
    """Rank 0's runner here, the followers spawned as `follower(rank, size, init_method,
    *follower_args)` (default: a bare runner follower for `engine_cfg`); at
    tensor_parallel_size 1 just a runner."""
    from splitserve.engine.hf_config import load_model_config
    from splitserve.engine.model_runner import ModelRunner, resolve_device
    from splitserve.engine.parallel import SINGLE, init_tp, rank_device

    size = engine_cfg.parallel.tensor_parallel_size
    load_model_config(engine_cfg.model_path).check_tensor_parallel(size)  # before spawning anything
    if size == 1:
        return RankSet(ModelRunner(engine_cfg, SINGLE))
    init_method, procs = spawn_followers(size, follower, *(follower_args or (engine_cfg,)))
    try:
        tp = init_tp(0, size, init_method, rank_device(resolve_device(engine_cfg.device), 0))
        runner = ModelRunner(engine_cfg, tp)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    publisher = ControlPublisher(tp)
    runner.mirror = publisher.publish
    return RankSet(runner, publisher, procs)
