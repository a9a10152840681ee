"""How long ucxx's progress thread sleeps in epoll_wait when no UCX event wakes it.

ucxx starts the thread with a 1 ms wait (`ThreadMode`: `epoll_timeout=1`), so an idle worker
wakes a thousand times a second: measured 1.9 % of a core on CPU (TCP) and 3-4 % on an H200, over
issue 32's 2 % goal. The thread does not need the timeout to make progress: UCX wakes it at once
for its own events (a message on TCP or shared memory; cuda_ipc / cuda_copy completions, which
UCX signals through the worker's event fd; every request this process submits, which ucxx
signals). Measured on CPU over TCP (loopback, 1 KiB round trips): wait 1 ms: idle 1.9 %, hot
round trip 0.11 ms, after 0.5 s idle 0.42 ms; wait 100 ms: idle 0.1 %, 0.08 ms, 0.43 ms.

    progress_wait_ms(configured, device, polls)
                                          the wait to use: kv_transfer.progress_wait_ms, or by
                                          default 100 ms, except ucxx's 1 ms on CUDA without
                                          poll_while_busy (a CUDA copy's completion would wait)
    apply_progress_wait(ms)               restarts ucxx's progress thread with that wait; call
                                          it before any transfer (the worker's start-up)
    BOOST.busy()                          around a transfer: with kv_transfer.poll_while_busy
                                          (default on CUDA), the thread polls while any transfer
                                          is in flight and goes back to its wait LINGER_S after
                                          the last one ended

Why poll while busy: a transfer's completion is found by one of the thread's progress calls;
for a cuda_ipc copy that call may come only when the thread's wait ends (ucxx's 1 ms), as the
flat ~0.5 ms of raw ucxx from 1 to 256 MiB on the H100 suggests (h100-2026-12-06/
kv_handover.json). `benchmarks/kvtransfer.py --poll-while-busy off|on` measures it. Switching the
thread costs ~0.3 ms (a stop joins it), so it stays polling LINGER_S after the last transfer:
under load it never switches, and an idle worker still sleeps (issue 32's idle bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

UCXX_DEFAULT_MS = 1
IDLE_DEFAULT_MS = 100

log = logging.getLogger("splitserve.kvtransfer")


def progress_wait_ms(configured: int | None, device_type: str, polls: bool = True) -> int:
    if configured is not None:
        return configured
    return IDLE_DEFAULT_MS if device_type == "cpu" or polls else UCXX_DEFAULT_MS


def set_up_progress(config, device_type: str) -> None:
    """A worker's start-up, before any transfer: the idle wait and polling while busy, from its
    KvTransferConfig."""
    polls = poll_while_busy(config.poll_while_busy, device_type)
    apply_progress_wait(progress_wait_ms(config.progress_wait_ms, device_type, polls))
    BOOST.configure(polls)


def poll_while_busy(configured: bool | None, device_type: str) -> bool:
    return configured if configured is not None else device_type != "cpu"


def apply_progress_wait(ms: int) -> bool:
    """True when the progress thread now waits `ms` (-1: for events only); False when ucxx's
    own thread was left as it is (the default wait, a polling mode, an unknown ucxx)."""
    BOOST.idle_ms = ms  # what a switch back from polling restores
    if ms == UCXX_DEFAULT_MS:
        return False
    try:
        _restart_thread(polling=False, wait_ms=ms)
    except _NotThreadMode:
        return False
    except (AttributeError, TypeError) as exc:
        log.warning("kv_transfer.progress_wait_ms %d not applied (this ucxx: %s)", ms, exc)
        return False
    BOOST.polling = False
    log.info("UCX progress thread waits %s between events", "for events" if ms < 0 else f"{ms} ms")
    return True


class _NotThreadMode(RuntimeError):
    pass


def _restart_thread(polling: bool, wait_ms: int) -> None:
    import ucxx

    ctx = ucxx.core._get_ctx()  # the process's one context (ucxx 0.52; private)
    if ctx.progress_mode != "thread":  # polling modes never sleep: nothing to set
        raise _NotThreadMode(f"progress mode {ctx.progress_mode!r}")
    ctx.worker.stop_progress_thread()
    ctx.worker.start_progress_thread(polling_mode=polling, epoll_timeout=wait_ms)


LINGER_S = 0.5


class ProgressBoost:
    """Process-wide (one ucxx context per process); event-loop thread only."""

    def __init__(self) -> None:
        self.enabled = False
        self.idle_ms = UCXX_DEFAULT_MS
        self.linger_s = LINGER_S
        self.switches = 0  # thread restarts, both ways (tests, logs)
        self.polling = False
        self._active = 0
        self._timer: asyncio.TimerHandle | None = None

    def configure(self, enabled: bool) -> None:
        self.enabled = enabled

    @contextlib.contextmanager
    def busy(self):
        counted = self._enter()
        try:
            yield
        finally:
            if counted:
                self._exit()

    def rest_now(self) -> None:
        """Back to the wait at once when nothing is in flight: a transfer owner's close (its
        loop may end before the linger's timer fires, which would leave the thread polling); also
        the linger's timer itself."""
        self._cancel_timer()
        if self._active == 0 and self.polling:
            self._switch(False)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _enter(self) -> bool:
        if not self.enabled:
            return False
        self._cancel_timer()
        if not self.polling:
            self._switch(True)
            if not self.enabled:  # the switch failed: this transfer runs without it
                return False
        self._active += 1
        return True

    def _exit(self) -> None:
        self._active -= 1
        if self._active == 0 and self.polling:
            self._timer = asyncio.get_running_loop().call_later(self.linger_s, self.rest_now)

    def _switch(self, polling: bool) -> None:
        try:
            _restart_thread(polling, self.idle_ms)
        except _NotThreadMode as exc:  # a polling mode already: nothing to do
            log.info("kv_transfer.poll_while_busy off (%s)", exc)
            self.enabled = False
            return
        except Exception as exc:  # an unknown ucxx: off, and the waiting thread back if it can
            log.warning("kv_transfer.poll_while_busy turned off (this ucxx: %s)", exc)
            self.enabled, self.polling = False, False
            with contextlib.suppress(Exception):
                _restart_thread(False, self.idle_ms)
            return
        self.polling = polling
        self.switches += 1


BOOST = ProgressBoost()
