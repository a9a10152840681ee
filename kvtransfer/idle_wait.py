"""Waiting for the next pull on an idle KV endpoint without burning a core.

ucxx's asyncio receive waits by polling its request from the event loop (`wait_yield`), so a
listener with a receive pending on every open endpoint kept about one core busy while idle
(measured: 96 % of a core for an idle prefill worker). ucxx's other mode (a notifier thread
resolving Python futures) idles well but made every transfer 2-3x slower on the H200
(1k-token hand-over 2.1 -> 4.0 ms). So the listener asks UCX whether a message with the
endpoint's tag has arrived (`tag_probe`, answered by ucxx's progress thread) and only then posts
the receive:

    hot    < HOT_S after the endpoint's last message, or < GRANT_HOT_S after a lease was
           granted or a streamed request queued (`PullWake.notify`): probe every loop turn, so
           back-to-back pulls and the pull that follows a grant through the router pay nothing
    warm   a lease is out (a pull may come): probe at most WARM_SLEEP_S apart, woken at once by
           a grant (asyncio's timers wait at least 1 ms: epoll's resolution)
    cold   no lease is out: sleep up to COLD_SLEEP_S, woken at once when one is granted,
           since only a granted lease can be pulled

Measured on CPU (TCP loopback, `benchmarks`-style probe, 2-block pulls): the request round trip
was 0.47 ms for a pull 1 ms after the last, but 1.5 ms 10 ms after and 2.7 ms 30 ms after, the
warm backoff's sleeps, when nothing woke a waiter on a grant; a pull after a grant now finds the
endpoint hot.

Uses ucxx's endpoint internals (`_ctx`, `_tags`); where they differ (another ucxx version) it
falls back to the plain receive. The KV listener runs this schedule once for all of its idle
endpoints (idle_watch.py); `until_message` waits for one endpoint (benchmarks' raw listener).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

HOT_S = 0.005
GRANT_HOT_S = 0.05  # a granted lease's pull comes after one router hop: a few ms
WARM_SLEEP_S = 0.002
COLD_SLEEP_S = 0.05


class PullWake:
    """Wakes every cold waiter when a lease is granted; `notify` may be called from any thread."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self.last = float("-inf")  # time.monotonic() of the last grant (loop thread)

    def notify(self) -> None:
        self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.last = time.monotonic()
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float, also: asyncio.Event | None = None) -> None:
        """Until a grant, `also` is set, or `timeout`."""
        waiters = [asyncio.ensure_future(self._event.wait())]
        if also is not None:
            waiters.append(asyncio.ensure_future(also.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()


def is_hot(now: float, last_message: float, wake: PullWake) -> bool:
    """Hot: a message came within HOT_S or a lease was granted within GRANT_HOT_S."""
    return now - last_message <= HOT_S or now - wake.last <= GRANT_HOT_S


def next_sleep(sleep: float, hot: bool, warm: Callable[[], bool]) -> float:
    """The schedule's next wait after one of `sleep`: 0 (hot: one loop turn), the warm backoff
    (1 ms, doubling up to WARM_SLEEP_S; from 1 ms again after a cold sleep) or COLD_SLEEP_S.
    `warm` is asked only when not hot."""
    if hot:
        return 0.0
    if not warm():
        return COLD_SLEEP_S
    return min(WARM_SLEEP_S, sleep * 2) if 0 < sleep <= WARM_SLEEP_S else 1e-3


def _prober(ep):
    """A function: has a message for `ep`'s receive tag arrived? None where unsupported."""
    try:
        from ucxx.types import Tag

        worker = ep._ctx.worker  # noqa: SLF001 - see the module docstring
        tag = ep._tags["msg_recv"]  # noqa: SLF001
        tag = tag if isinstance(tag, Tag) else Tag(tag)
        worker.tag_probe(tag)  # fails here, not later, where the API differs
    except Exception:  # noqa: BLE001 - any mismatch: the plain (polling) receive
        return None
    return lambda: worker.tag_probe(tag).matched


async def until_message(
    ep, last_message: float, expecting: Callable[[], bool], wake: PullWake
) -> None:
    """Returns once a message for `ep` is waiting (or the endpoint closed)."""
    probe = _prober(ep)
    if probe is None:
        return
    sleep = 0.0
    while not ep.closed and not probe():
        sleep = next_sleep(sleep, is_hot(time.monotonic(), last_message, wake), expecting)
        if sleep:
            await wake.wait(sleep)
        else:
            await asyncio.sleep(0)
