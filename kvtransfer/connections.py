"""What a peer of the KV listener may hold: its connections, their idle time, its messages.

The listener accepts any peer that speaks UCX, and each connection costs three fds and memory,
so every accepted endpoint lives under these rules (decode workers never break them):

- its first message is a KvPullRequest within lease_request_timeout_s of the connect (a decode
  worker connects to pull, and sends the request at once); anything else closes it;
- a pull refused (unknown or expired lease, incompatible geometry) closes it: a decode worker
  discards an endpoint after a refusal; it gets lease_request_timeout_s to read the reply;
- idle for idle_timeout_s, it is closed; the decode side's endpoint pool then connects anew
  (a cached endpoint found dead before any byte of a pull moved gets one retry);
- active messages (no KV peer sends any; ucxx keeps them for good) close it;
- at max_connections a new connection replaces the endpoint idle the longest (one refused or
  that never sent a request first); with every endpoint mid-pull it is refused.

Messages on tags no endpoint receives are dropped by the idle watch (idle_watch.py, strays).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from splitserve.kvtransfer import frames, quiet_wait
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.idle_watch import IdleWatch, accepted, drain_active_messages, wire_tag
from splitserve.protos import kv_pb2

log = logging.getLogger("splitserve.kvtransfer")
NEW, IDLE, BUSY, REFUSED = "new", "idle", "busy", "refused"
_EVICT_ORDER = {REFUSED: 0, NEW: 1, IDLE: 2}  # who goes first when the listener is full
_WHY = {"closed": "closed by the peer", "timeout": "idle", "am": "active messages"}
_MISBEHAVIOUR = ("no request", "malformed request", "active messages", "message after a refusal")
WARN_EVERY_S = 60.0

# serve(ep, request, buf) -> whether the endpoint may serve another pull
Serve = Callable[[object, kv_pb2.KvPullRequest, object], Awaitable[bool]]


class _Conn:
    __slots__ = ("ep", "tag", "state", "since", "evicted")

    def __init__(self, ep, tag: int) -> None:
        self.ep, self.tag, self.state = ep, tag, NEW
        self.since = time.monotonic()  # of its last state change
        self.evicted = False

    def enter(self, state: str) -> None:
        self.state, self.since = state, time.monotonic()


class Connections:
    def __init__(self, config: KvTransferConfig, watch: IdleWatch) -> None:
        self.config = config
        self.watch = watch
        self.handlers: dict[asyncio.Task, _Conn] = {}  # handler task -> its connection
        self.closed: dict[str, int] = {}  # why -> connections closed for it (tests, logs)
        self._warned: dict[str, float] = {}  # what -> when it was last logged

    def __len__(self) -> int:
        return sum(not c.evicted for c in self.handlers.values())

    async def run(self, ep, serve: Serve) -> None:
        """Serves `ep`'s pulls (its handler task) until a rule above closes it."""
        tag = wire_tag(ep)
        conn = self._admit(ep, tag)
        if conn is None:
            return
        why = "closed by the peer"
        try:
            why = await self._serve(conn, serve)
        except Exception as exc:  # the peer closed or died mid-pull: nothing to clean but it
            why = f"failed: {type(exc).__name__}"
            log.debug("KV endpoint closed: %s", exc)
        finally:
            self._drop(conn, why)

    async def _serve(self, conn: _Conn, serve: Serve) -> str:
        cfg, ep = self.config, conn.ep
        buf = frames.new_buffer()
        last = time.monotonic()  # hot at once: the first request follows the connect
        deadline = last + cfg.lease_request_timeout_s
        while True:
            got = await self.watch.wait(ep, conn.tag, last, deadline)
            if conn.evicted:  # (its wait may have ended just before the eviction)
                return "evicted"
            if got != "message":
                return _WHY.get(got, got) if got != "timeout" or conn.state != NEW else "no request"
            conn.enter(BUSY)
            self.watch.sweep()  # strays are dropped while it is busy too
            try:
                req = await quiet_wait.recv_frame(
                    ep, kv_pb2.KvPullRequest, buf, cfg.lease_request_timeout_s
                )
            except Exception:  # noqa: BLE001 - not a request: the peer is no KV client
                return "malformed request"
            keep = await serve(ep, req, buf)
            last = time.monotonic()
            if not keep:  # its reply is on the way; a decode worker closes the endpoint now
                conn.enter(REFUSED)
                got = await self.watch.wait(ep, conn.tag, last, last + cfg.lease_request_timeout_s)
                return "message after a refusal" if got == "message" else "refused"
            conn.enter(IDLE)
            deadline = last + cfg.idle_timeout_s

    def _admit(self, ep, tag: int | None) -> _Conn | None:
        accepted(tag)  # live from now on, or a refused endpoint's: then its messages are strays
        if tag is None:  # another ucxx: no idle watch, so no endpoint either
            log.error("KV endpoint refused: this ucxx's endpoints have no receive tag")
            ep.abort()
            return None
        if len(self) >= self.config.max_connections:
            victims = [c for c in self.handlers.values() if c.state in _EVICT_ORDER]
            victims = [c for c in victims if not c.evicted]
            self._warn_full(bool(victims))
            if not victims:
                self.closed["full"] = self.closed.get("full", 0) + 1
                ep.abort()
                return None
            victim = min(victims, key=lambda c: (_EVICT_ORDER[c.state], c.since))
            victim.evicted = True
            self.watch.cancel(victim.tag, "evicted")
        conn = _Conn(ep, tag)
        self.handlers[asyncio.current_task()] = conn
        self.watch.live.add(tag)
        return conn

    def _drop(self, conn: _Conn, why: str) -> None:
        self.handlers.pop(asyncio.current_task(), None)
        self.watch.live.discard(conn.tag)
        self.closed[why] = self.closed.get(why, 0) + 1
        drain_active_messages(conn.ep)
        if not conn.ep.closed:
            conn.ep.abort()
        self.watch.sweep()
        if why in _MISBEHAVIOUR and self._may_log(why):
            log.warning("KV endpoint closed: %s (more within %.0fs: DEBUG)", why, WARN_EVERY_S)
        else:
            log.debug("KV endpoint closed: %s", why)

    def _may_log(self, what: str) -> bool:
        """At most one warning per WARN_EVERY_S for each `what` (a flood logs little)."""
        now = time.monotonic()
        if now - self._warned.get(what, float("-inf")) < WARN_EVERY_S:
            return False
        self._warned[what] = now
        return True

    def _warn_full(self, replacing: bool) -> None:
        if self._may_log("full"):
            log.warning(
                "KV listener at kv_transfer.max_connections (%d): %s",
                self.config.max_connections,
                "a new connection replaces the longest idle one"
                if replacing
                else "every connection is mid-pull: new ones are refused",
            )

    def close_all(self) -> list[asyncio.Task]:
        """Aborts every endpoint (their peers see a dead connection); returns their handlers."""
        for task, conn in list(self.handlers.items()):
            if not conn.ep.closed:
                conn.ep.abort()
            self.watch.cancel(conn.tag, "shutdown")
            task.cancel()
        return list(self.handlers)
