"""How rank 0 of a tensor-parallel worker drives its followers: spawn, publish, follow (the
follower's side of start-up and of the command loop is tp_follower.py).

    rank 0 (gRPC, scheduler, sampler)                    follower rank r (no server)
    ─────────────────────────────────                    ───────────────────────────
    control key (new per launch), rendezvous store
    spawn_followers(launch: key, store address) ────────▶ follower entry: check in, init_tp,
    join_group(): every follower checked in, then join      build runner
    runner.mirror = publisher.publish                     loop: cmd = receive(control)
      runner.prefill(chunks) ─▶ ("prefill", chunks) ─┐          ("prefill", chunks)  -> runner.prefill
      runner.zero_kv()       ─▶ ("zero_kv",)        ├─gloo─▶   ("zero_kv",)         -> runner.zero_kv
      graph runner / leases  ─▶ (their commands)    │          other commands       -> handlers[name]
      close()                ─▶ ("stop",)          ─┘          ("stop",)            -> return

Commands are encoded as typed payloads when published (tp_messages.py: a command the format
cannot carry fails its caller), then travel in publish order over the gloo `cpu_group`, numbered
and HMAC-signed with the launch's key (tp_channel.py; no pickle), from one sender thread, so rank
0's callers never wait for a follower; every rank therefore issues the model's collectives
(device_group) in the same order. A follower refuses a message that fails a check (one log line,
exit CONTROL_REFUSED_EXIT), which rank 0 sees as a lost rank. Followers die with rank 0: a parent
watchdog (the parent pid changes) and a dead control connection both end them. Rank 0 learns
of a dead follower at once while starting (start_ranks fails) and while serving
(RankSet.watch; the worker then fails its requests and exits: tp_lifecycle.py).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import queue
import threading
import time
from collections.abc import Callable

from splitserve.engine.parallel import TPGroup
from splitserve.engine.tp_channel import ControlSender, FollowerLaunch, new_control_key
from splitserve.engine.tp_follower import runner_follower_main
from splitserve.engine.tp_messages import KIND, encode_command

log = logging.getLogger(__name__)


def spawn_followers(size: int, launch: FollowerLaunch, target: Callable, *args) -> list[mp.Process]:
    """Starts ranks 1..size-1 as `target(rank, size, launch, *args)` (picklable args: they go down
    the spawn pipe, the one channel that carries the control key)."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, size):
        p = ctx.Process(
            target=target,
            args=(rank, size, launch, *args),
            daemon=True,
            name=f"splitserve-tp-rank{rank}",
        )
        p.start()
        procs.append(p)
    return procs


def _dead(procs: list[mp.Process]) -> tuple[int, mp.Process] | None:
    """The first follower (rank, process) that has exited, if any. `is_alive()` (waitpid, which
    also sets the exit code) alone reports a child reaped by someone else as alive forever, and
    the sentinel alone stays open while a grandchild holds the pipe: a follower is dead when
    any of the three signals says so (a pid that no longer exists is the third)."""
    if not procs:
        return None
    ended = set(mp_connection.wait([p.sentinel for p in procs], timeout=0))
    return next(((r, p) for r, p in enumerate(procs, 1) if _ended(p, ended)), None)


def _ended(p: mp.Process, sentinels_ready: set) -> bool:
    if not p.is_alive() or p.sentinel in sentinels_ready:
        return True
    try:
        os.kill(p.pid, 0)
    except ProcessLookupError:  # reaped elsewhere: no zombie left to wait for
        return True
    except PermissionError:
        pass
    return False


def _until(done: Callable[[], bool], procs: list[mp.Process], timeout_s: float, what: str) -> None:
    """Rank 0 during start-up: polls until `done()`; RuntimeError as soon as a follower exits (a
    failed import, a bad device, a crash) instead of waiting out the group's timeout."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if (dead := _dead(procs)) is not None:
            rank, p = dead
            raise RuntimeError(
                f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode} {what}; "
                f"its own error (a traceback, or lines tagged tp{rank}) is in this log above"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"tensor-parallel ranks did not finish {what} within {timeout_s:.0f}s; "
                "see their log lines (tagged tp1, tp2, ...) above"
            )
        time.sleep(0.05)


def join_group(store, procs: list[mp.Process], device, control_key: bytes) -> TPGroup:
    """Rank 0's side of start-up: waits for every follower to check in, then joins the group in a
    helper thread while watching the followers, so a follower dying in between (say, in NCCL's
    communicator set-up, which need not honour the store's timeout) fails rank 0 at once too."""
    from splitserve.engine.parallel import JOIN_TIMEOUT, init_tp, joined_key

    size, limit = len(procs) + 1, JOIN_TIMEOUT.total_seconds()
    keys = [joined_key(r) for r in range(1, size)]
    _until(lambda: store.check(keys), procs, limit, "during start-up, before joining the group")
    box: dict = {}

    def join() -> None:
        try:
            box["tp"] = init_tp(0, size, "", device, store=store, control_key=control_key)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc

    t = threading.Thread(target=join, name="tp-join", daemon=True)
    t.start()
    _until(lambda: not t.is_alive(), procs, limit + 10, "while joining the group")
    if "error" in box:
        raise box["error"]
    return box["tp"]


def watch_followers(
    procs: list[mp.Process],
    on_death: Callable[[int, int | None], None],
    stopping: threading.Event | None = None,
) -> threading.Thread:
    """Rank 0: `on_death(rank, exitcode)` once, the first time a follower is found dead, unless
    `stopping` is set first (a clean stop: the followers exit on ("stop",))."""
    stopping = stopping or threading.Event()

    def watch() -> None:
        while not stopping.wait(0.2):
            if (dead := _dead(procs)) is not None:
                if not stopping.is_set():
                    on_death(dead[0], dead[1].exitcode)
                return

    t = threading.Thread(target=watch, name="tp-follower-watch", daemon=True)
    t.start()
    return t


class ControlPublisher:
    """Rank 0's end of the command stream: `publish` encodes and queues, one thread sends in
    order."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.sender = ControlSender(tp)
        self.failed: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tp-publish", daemon=True)
        self._thread.start()

    def publish(self, cmd: tuple) -> None:
        if self.failed is not None:
            raise RuntimeError(
                f"tensor-parallel followers are gone ({self.failed!r}); the worker stops serving"
            )
        # encoded here: a snapshot of the caller's lists, and a bad command fails its caller
        self._queue.put(encode_command(cmd))

    def _run(self) -> None:
        while True:
            kind, payload = self._queue.get()
            try:
                self.sender.send(kind, payload)
            except Exception as exc:  # a follower died: the next collective fails on rank 0 as well
                log.error("tensor-parallel control stream broken: %r", exc)
                self.failed = exc
                return
            if kind == KIND["stop"]:
                return

    def close(self, timeout: float = 10.0) -> None:
        """Tells the followers to stop (after every queued command); idempotent."""
        if self._thread.is_alive() and self.failed is None:
            self._queue.put(encode_command(("stop",)))
            self._thread.join(timeout)


class RankSet:
    """Rank 0's view of its worker's ranks: the runner (rank 0's), the publisher, the followers."""

    def __init__(
        self,
        runner,
        publisher: ControlPublisher | None = None,
        procs: list[mp.Process] | None = None,
    ):
        self.runner, self.publisher, self.procs = runner, publisher, procs or []
        self.stopping = (
            threading.Event()
        )  # set before a clean stop: followers exiting then is no failure

    def watch(self, on_death: Callable[[int, int | None], None]) -> None:
        """`on_death(rank, exitcode)` (on a watcher thread) when a follower dies while serving."""
        if self.procs:
            watch_followers(self.procs, on_death, self.stopping)

    def kill(self) -> None:
        """The followers, at once (rank 0 gives up after losing one of them)."""
        self.stopping.set()
        for p in self.procs:
            p.kill()

    def close(self, timeout: float = 30.0) -> None:
        """Stops the followers (after the commands already published) and leaves the group;
        idempotent."""
        from splitserve.engine.parallel import destroy_tp
        from splitserve.engine.tp_follower import STOP_GRACE_S

        self.stopping.set()
        if self.publisher is not None:
            self.publisher.close(timeout)
        deadline = time.monotonic() + min(timeout, STOP_GRACE_S + 4)  # inside the exit deadline
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():  # past its own stop grace: its teardown hangs
                log.warning("tensor-parallel rank %s did not exit after stop; killing it", p.name)
                p.kill()
                p.join(5)
        destroy_tp(self.runner.tp)


def start_ranks(
    engine_cfg,
    follower: Callable = runner_follower_main,
    *follower_args,
    secret: bytes | None = None,
) -> RankSet:
    """Rank 0's runner here, the followers spawned as `follower(rank, size, launch,
    *follower_args)` (default: a bare runner follower for `engine_cfg`); at
    tensor_parallel_size 1 just a runner. Fails at once (one line) when the model does not split
    or the GPUs are too few, and as soon as a follower exits during start-up. The control key is
    new per launch, derived from `secret` (default: the deployment's `cluster_secret()`) when
    there is one (tp_channel.py)."""
    from splitserve.config.hf_config import load_model_config
    from splitserve.engine.model_runner import ModelRunner, resolve_device
    from splitserve.engine.parallel import SINGLE, check_devices, rank_device, rendezvous_store
    from splitserve.service.credentials import cluster_secret

    size = engine_cfg.parallel.tensor_parallel_size
    device = resolve_device(engine_cfg.device)
    load_model_config(engine_cfg.model_path).check_tensor_parallel(size)  # before spawning anything
    check_devices(device, size)
    if size == 1:
        return RankSet(ModelRunner(engine_cfg, SINGLE))
    key = new_control_key(secret if secret is not None else cluster_secret())
    store, init_method = rendezvous_store(size)
    launch = FollowerLaunch(init_method, key)
    procs = spawn_followers(size, launch, follower, *(follower_args or (engine_cfg,)))
    try:
        tp = join_group(store, procs, rank_device(device, 0), key)
        runner = ModelRunner(engine_cfg, tp)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    publisher = ControlPublisher(tp)
    runner.mirror = publisher.publish
    return RankSet(runner, publisher, procs)
