"""A tensor-parallel follower rank's side (rank r > 0): start-up, then the command loop.

A follower process (spawned by rank 0: tp_control.py, with a `FollowerLaunch`: the rendezvous
address and the launch's control key) starts through `join_as_follower` (tied to rank 0's life
by `die_with_parent`, its log lines tagged tp<r>, on its own device, joined to the group), then
`follow`s: it receives rank 0's commands over the gloo `cpu_group` (tp_channel.py: typed,
numbered, HMAC-checked; no pickle) and runs each on its own runner until ("stop",). A message
that fails a check ends the process at once: one ERROR line saying why, exit
CONTROL_REFUSED_EXIT (rank 0 then sees a lost rank). `follower_process` wraps a follower's entry
so the process ends right after it; `runner_follower_main` is the follower of a bare ModelRunner.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

from splitserve.engine.parallel import TPGroup
from splitserve.engine.tp_channel import ControlReceiver, FollowerLaunch
from splitserve.engine.tp_messages import ControlMessageError

log = logging.getLogger(__name__)
STOP_GRACE_S = 5.0  # a follower's teardown after ("stop",), then it exits regardless
CONTROL_REFUSED_EXIT = 3  # a follower's status after refusing a control message


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


def receive(control: ControlReceiver) -> tuple:
    """Rank 0's next command; a message that fails a check ends this process (no teardown: the
    stream can no longer be trusted, and rank 0 handles a lost rank)."""
    try:
        return control.receive()
    except ControlMessageError as exc:
        from splitserve.service.service_process import exit_now

        log.error(
            "tensor-parallel rank %d refused a control message from rank 0 and stops: %s",
            control.tp.rank,
            exc,
        )
        exit_now(CONTROL_REFUSED_EXIT)
        raise  # not reached


def follow(tp: TPGroup, runner, handlers: Mapping[str, Callable] | None = None) -> None:
    """A follower's loop: runs rank 0's commands on its own runner until ("stop",)."""
    if runner.device.type == "cuda":  # this thread launches on the rank's GPU (Triton, graphs)
        import torch

        torch.cuda.set_device(runner.device)
    handlers = dict(handlers or {})
    handlers.setdefault("prefill", lambda chunks: runner.prefill(chunks))
    handlers.setdefault("decode", lambda lanes: runner.decode(lanes))
    handlers.setdefault("zero_kv", lambda: runner.zero_kv())
    control = ControlReceiver(tp)
    while True:
        cmd = receive(control)
        if cmd[0] == "stop":
            _exit_soon(STOP_GRACE_S)
            return
        handlers[cmd[0]](*cmd[1:])


def _exit_soon(seconds: float) -> None:
    """After ("stop",) the follower's own teardown (its UCX listener, the process group) gets
    `seconds`; one that hangs must not keep rank 0 waiting to join it (seen on a loaded 2-core
    machine: rank 0 past its stop deadline, exit 3)."""
    import faulthandler

    from splitserve.service.service_process import exit_now

    # a teardown stuck in C with the GIL held starves the timer thread below; faulthandler's
    # watchdog is a C thread: it dumps the stacks and exits (status 1) without the GIL
    faulthandler.dump_traceback_later(seconds + 2, exit=True)

    def expire() -> None:
        time.sleep(seconds)
        log.warning("follower teardown still running %.0fs after stop; exiting", seconds)
        exit_now(0)

    threading.Thread(target=expire, name="tp-stop-deadline", daemon=True).start()


def follower_process(main: Callable[..., None]) -> Callable[..., None]:
    """Decorates a follower's entry: the process ends right after it (status 0, or 1 with the
    traceback logged), without the interpreter's exit, whose garbage collection of UCX
    listeners and endpoints could hang it (service/service_process.py)."""

    @functools.wraps(main)
    def run(*args) -> None:
        from splitserve.service.service_process import exit_now

        try:
            main(*args)
        except BaseException:  # noqa: BLE001 - reported, then the process ends with 1
            log.exception("tensor-parallel follower failed")
            exit_now(1)
        exit_now(0)

    return run


def join_as_follower(rank: int, size: int, launch: FollowerLaunch, engine_cfg) -> TPGroup:
    """A follower process's start: tied to rank 0's life, logging tagged with its rank, on its
    own device (cuda:rank), joined to the TP group (holding the launch's control key)."""
    from splitserve.engine.model_runner import resolve_device
    from splitserve.engine.parallel import init_tp, rank_device

    die_with_parent()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s"
    )
    import torch

    device = rank_device(resolve_device(engine_cfg.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # CPU ranks share the cores: each its share, so `size` ranks do not oversubscribe them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return init_tp(rank, size, launch.init_method, device, control_key=launch.control_key)


@follower_process
def runner_follower_main(rank: int, size: int, launch: FollowerLaunch, engine_cfg) -> None:
    """Follower of a bare ModelRunner driven by rank 0 (OfflineEngine, tests)."""
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.parallel import destroy_tp

    tp = join_as_follower(rank, size, launch, engine_cfg)
    try:
        follow(tp, ModelRunner(engine_cfg, tp))
    finally:
        destroy_tp(tp)
