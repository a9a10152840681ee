"""One task that waits for the next message of every idle endpoint of a KV listener.

idle_wait.until_message probes for one endpoint; run once per endpoint, 1000 idle connections
cost up to a core (measured: 0.66-1) and slowed every request. Here one task serves them all:
one `tag_probe` with a zero mask asks UCX whether any message is waiting, and the oldest one's
tag names its endpoint. Only when that message is no idle endpoint's (a busy endpoint's, about
to be received, or a stray) are the idle endpoints probed one by one. The hot / warm / cold
schedule is idle_wait's, over the whole set: hot while any endpoint had a message within HOT_S
or a lease was granted within GRANT_HOT_S.

Every SCAN_S it also ends the waits of endpoints that closed, passed their deadline, or were
sent active messages (no KV peer sends any; ucxx keeps them per endpoint and never frees them).

Strays (`drain_strays`: this process's UCX worker serves this listener only, as in a prefill
worker): a waiting message whose tag is no accepted endpoint's is received into a scratch
buffer and dropped. Messages nobody receives otherwise stay in UCX's unexpected queue for good,
even after their endpoint closed (measured: 1 KiB messages took the RSS from 0.4 to 1.6 GB).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from splitserve.kvtransfer.idle_wait import PullWake, is_hot, next_sleep

log = logging.getLogger("splitserve.kvtransfer")
SCAN_S = 0.05
SWEEP_S = 1.0  # strays are looked for this long after a connection closed or the last stray
DRAIN_BATCH = 256  # strays received per loop turn
MAX_DRAINING = 1024  # stray receives not yet complete (a rendezvous one waits for its sender)
DRAIN_BYTES = 65536  # longer strays are truncated, which drops them just the same


class _Waiter:
    __slots__ = ("ep", "tag", "deadline", "future")

    def __init__(self, ep, tag: int, deadline: float) -> None:
        self.ep, self.tag, self.deadline = ep, tag, deadline
        self.future = asyncio.get_running_loop().create_future()


def wire_tag(ep) -> int | None:
    """The UCX tag `ep`'s control frames arrive with (None where ucxx differs)."""
    tags = getattr(ep, "_tags", None)  # noqa: SLF001 - ucxx internals, as idle_wait's
    tag = tags.get("msg_recv") if isinstance(tags, dict) else None
    return getattr(tag, "value", tag)


# Tags of endpoints still in ucxx's accept handshake: the peer may send its first request
# before the listener's handler knows the endpoint, so such a message is no stray
_HANDSHAKES: dict[int, float] = {}  # tag -> monotonic time of its handshake's start
HANDSHAKE_S = 60.0  # an entry older than this is forgotten (its handshake failed)


def note_handshakes() -> bool:
    """Makes ucxx's listener handshake note each new endpoint's receive tag (idempotent);
    False where ucxx's listener differs (strays then cannot be told from early requests)."""
    from ucxx._lib_async import listener

    exchange = getattr(listener, "exchange_peer_info", None)
    if exchange is None:
        return False
    if getattr(exchange, "_notes_tags", False):
        return True

    async def noting(endpoint, msg_tag, listener, connect_timeout=5.0):
        if listener:
            now = time.monotonic()
            for old in [t for t, t0 in _HANDSHAKES.items() if now - t0 > HANDSHAKE_S]:
                del _HANDSHAKES[old]
            _HANDSHAKES[msg_tag] = now
        return await exchange(endpoint, msg_tag, listener, connect_timeout)

    noting._notes_tags = True
    listener.exchange_peer_info = noting
    return True


def accepted(tag: int) -> None:
    """The listener's handler has the endpoint: its tag is live, no longer a handshake's."""
    _HANDSHAKES.pop(tag, None)


def _head(worker) -> int | None:
    """The tag of the oldest message waiting in UCX (any tag), None when there is none."""
    from ucxx.types import Tag, TagMask

    head = worker.tag_probe(Tag(0), TagMask(0))
    return getattr(head.sender_tag, "value", head.sender_tag) if head.matched else None


def has_active_messages(ep) -> bool:
    """Whether `ep` was ever sent an active message (ucxx's probe stays true once it was)."""
    inner = getattr(ep, "_ep", None)
    try:
        return inner is not None and inner.am_probe()
    except Exception:  # noqa: BLE001 - no AM support: none can arrive
        return False


def drain_active_messages(ep, limit: int = 100_000) -> int:
    """Takes the active messages ucxx holds for `ep` (each frees its buffer); stops at the first
    not already there (that one waits for the next, which then is freed too)."""
    inner = getattr(ep, "_ep", None)
    n = 0
    try:
        while inner is not None and n < limit and inner.am_probe():
            n += 1
            if not inner.am_recv().completed:
                break
    except Exception:  # noqa: BLE001 - the endpoint went away meanwhile
        pass
    return n


class IdleWatch:
    def __init__(
        self, wake: PullWake, expecting: Callable[[], bool], drain_strays: bool = False
    ) -> None:
        self.wake = wake
        self.expecting = expecting
        self.drain_strays = drain_strays and note_handshakes()
        if drain_strays and not self.drain_strays:
            log.warning("this ucxx's listener differs: stray KV messages are not dropped")
        self.live: set[int] = set()  # tags of every accepted endpoint, idle or busy
        self.probes = 0  # tag probes made (tests)
        self.drained = 0  # strays dropped
        self._idle: dict[int, _Waiter] = {}
        self._last_message = float("-inf")
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._draining: deque = deque()
        self._scratch = None
        self._sweep_until = float("-inf")

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def wait(self, ep, tag: int, last_message: float, deadline: float) -> str:
        """'message' once one waits for `ep`; else 'closed', 'timeout' (at `deadline`), 'am'
        (active messages came) or what `cancel` said."""
        waiter = _Waiter(ep, tag, deadline)
        self._idle[tag] = waiter
        self._last_message = max(self._last_message, last_message)
        self._start()
        try:
            return await waiter.future
        finally:
            if self._idle.get(tag) is waiter:
                del self._idle[tag]

    def sweep(self) -> None:
        """A connection closed or went busy: strays are looked for while any connection lives,
        and SWEEP_S after the last (a closed one's, sent up to its end)."""
        if self.drain_strays:
            self._sweep_until = time.monotonic() + SWEEP_S
            self._start()

    def _start(self) -> None:
        self._kick.set()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        self._sweep_until = float("-inf")
        if self._task is not None:
            self._task.cancel()

    def _running(self) -> bool:
        if self._idle or time.monotonic() < self._sweep_until:
            return True
        return self.drain_strays and bool(self.live)  # a busy peer may send strays meanwhile

    def cancel(self, tag: int, why: str) -> None:
        waiter = self._idle.pop(tag, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_result(why)

    def _resolve(self, waiter: _Waiter, why: str) -> None:
        self.cancel(waiter.tag, why)

    async def _run(self) -> None:
        import ucxx

        worker = ucxx.core._get_ctx().worker  # noqa: SLF001 - the one worker of the process
        sleep, next_scan = 0.0, 0.0
        while self._running():
            self._kick.clear()
            now = time.monotonic()
            try:
                busy = self._dispatch(worker)
                if now >= next_scan:
                    self._scan(now)
                    next_scan = now + SCAN_S
            except Exception:  # never leave the idle endpoints without a watch
                log.exception("KV idle watch failed a turn")
                busy = False
                await asyncio.sleep(SCAN_S)
            if not self._running():
                break
            # hot: the next turn at once; else asleep until a grant, a new idle endpoint, or the
            # next scan is due; with no idle endpoint (strays only) cold, whatever leases are out
            hot = busy or is_hot(now, self._last_message, self.wake)
            sleep = next_sleep(sleep, hot, lambda: bool(self._idle) and self.expecting())
            if not sleep:
                await asyncio.sleep(0)
                continue
            await self.wake.wait(min(sleep, max(next_scan - now, 1e-3)), also=self._kick)

    def _dispatch(self, worker) -> bool:
        """Wakes the idle endpoints whose message came; True when strays were dropped (more
        may follow at once: the next turn comes without a sleep)."""
        from ucxx.types import Tag

        self.probes += 1
        head = _head(worker)
        if head is None:
            return False
        waiter = self._idle.get(head)
        if waiter is not None:
            self._resolve(waiter, "message")
            return False
        if self._stray(head) and self._drain(worker):
            return True
        for waiter in list(self._idle.values()):  # the oldest message hides the rest
            self.probes += 1
            if worker.tag_probe(Tag(waiter.tag)).matched:
                self._resolve(waiter, "message")
        return False

    def _stray(self, tag: int) -> bool:
        return self.drain_strays and tag not in self.live and tag not in _HANDSHAKES

    def _drain(self, worker) -> bool:
        """Receives and drops the strays at the head of UCX's queue; True when it took any."""
        import numpy as np
        from ucxx._lib.arr import Array
        from ucxx.types import Tag

        if self._scratch is None:  # shared by every stray: their bytes are never read
            self._scratch = Array(np.empty(DRAIN_BYTES, np.uint8))
        while self._draining and self._draining[0].completed:
            self._draining.popleft()
        taken = 0
        while taken < DRAIN_BATCH and len(self._draining) < MAX_DRAINING:
            head = _head(worker)
            if head is None or not self._stray(head):
                break
            # removed by its own tag: never an accepted endpoint's message
            info = worker.tag_probe(Tag(head), remove=True)
            if not info.matched:
                break
            self._draining.append(worker.tag_recv_with_handle(self._scratch, info))
            taken += 1
        self.drained += taken
        if taken:
            self._sweep_until = time.monotonic() + SWEEP_S
        return taken > 0

    def _scan(self, now: float) -> None:
        for waiter in list(self._idle.values()):
            if waiter.ep.closed:
                self._resolve(waiter, "closed")
            elif now >= waiter.deadline:
                self._resolve(waiter, "timeout")
            elif has_active_messages(waiter.ep):
                self._resolve(waiter, "am")
