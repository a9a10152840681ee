"""How a service process starts and ends: with its launcher, and on its own terms.

    die_with_launcher()        first thing in a CLI entry: a child of `splitserve serve` (or of
                               a test) ends with its launcher, even one killed with SIGKILL
    run_service_process(main)  asyncio.run(main()); end_cli(code) then flushes the logs and
                               calls os._exit(code):
                               everything was closed in order by the service's stop(), so
                               nothing is left for the interpreter's garbage collection, which
                               hung now and then at exit (a ucxx Listener destroyed while its
                               handler was alive; gRPC threads)
    EXIT_DEADLINE.arm(s)       from the drain on (GrpcServer.drain): a stop that has not ended
                               `s` seconds later logs what is stuck and exits EXIT_STUCK (3)
                               instead of hanging; only in a service process, never in pytest

The death signal used to be set in the launcher's `preexec_fn`, which runs Python between fork
and exec in a process that holds live gRPC channels and threads; now the child sets it itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine

log = logging.getLogger(__name__)

PARENT_ENV = "SPLITSERVE_DIE_WITH_PID"  # set by the launcher: the pid this child must not outlive
EXIT_STUCK = 3
_PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """SIGTERM this process when the launcher named in PARENT_ENV dies (Linux); the variable is
    removed so that grandchildren (tensor-parallel followers, which watch rank 0) do not inherit it."""
    pid = os.environ.pop(PARENT_ENV, "")
    if not pid.isdigit():
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(pid):  # the launcher died before the death signal was set
        os.kill(os.getpid(), signal.SIGTERM)


EXIT_STACKS_AFTER_S = 3.0


def exit_now(code: int) -> None:
    """Flush logs and stdio, then end the process without running finalisers. An exit still
    running EXIT_STACKS_AFTER_S later (a thread holding a log handler's lock, or the GIL in C)
    dumps every thread's stack into the log (faulthandler's C watchdog: it needs no GIL)."""
    with contextlib.suppress(Exception):
        faulthandler.dump_traceback_later(EXIT_STACKS_AFTER_S)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class ExitDeadline:
    """One per process: after arm(s), a stop still running s seconds later ends the process.
    Arming again can only bring the deadline closer (the drain arms it for announce + grace +
    stop_timeout, the end of the drain for stop_timeout)."""

    def __init__(self) -> None:
        self.enabled = False  # set by run_service_process: in-process tests never exit this way
        self._deadline: float | None = None
        self._what = ""
        self._lock = threading.Lock()

    def arm(self, seconds: float, what: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            deadline = time.monotonic() + seconds
            start = self._deadline is None
            if start or deadline < self._deadline:
                self._deadline, self._what = deadline, what
        if start:
            threading.Thread(target=self._expire, name="exit-deadline", daemon=True).start()

    def _expire(self) -> None:
        while (left := self._deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))
        stuck = ", ".join(
            sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
        )
        log.error(
            "%s did not stop in time (threads left: %s); their stacks follow; exiting with status %d",
            self._what,
            stuck,
            EXIT_STUCK,
        )
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(all_threads=True)
        exit_now(EXIT_STUCK)


EXIT_DEADLINE = ExitDeadline()


def run_service_process(main: Callable[[], Coroutine[object, object, int]]) -> int:
    """Runs a service until it stops; its exit code. The CLI entry then ends the process through
    `end_cli` (also after a failed start, whose one-line error it prints first).

    Not asyncio.run: its teardown waits without bound for leftover tasks to finish cancelling and
    for every default-executor thread to return (one still inside a blocking call holds the exit
    for seconds under load); the service's stop() closed everything in order already, and the
    process ends through exit_now right after, so nothing is left to tear down."""
    EXIT_DEADLINE.enabled = True
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    return int(loop.run_until_complete(main()) or 0)


def end_with_exit_now() -> None:
    """A command that is not a service but ran gRPC channels and child processes (`serve`) ends
    through exit_now too: the interpreter's own shutdown of gRPC's threads is what hangs."""
    global _END_WITH_EXIT_NOW
    _END_WITH_EXIT_NOW = True


_END_WITH_EXIT_NOW = False


def service_ran() -> bool:
    """Whether this process ran a service (and so must end through end_cli's exit_now)."""
    return EXIT_DEADLINE.enabled


def end_cli(code: int) -> int:
    """The CLI's last step: a process that ran a service exits here at once (exit_now); any other
    command returns its code as usual."""
    if EXIT_DEADLINE.enabled or _END_WITH_EXIT_NOW:
        exit_now(code)
    return code
