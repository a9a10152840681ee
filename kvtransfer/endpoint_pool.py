"""UCX endpoints of the decode side's KV pulls, kept per prefill host:port for reuse.

`acquire` hands out an idle cached endpoint (or connects a new one, `KvTransferError("connect")`
when the peer is unreachable); `release` returns a healthy one after a pull, `discard` aborts
one that failed (the next pull connects afresh). At most `max_per_peer` endpoints per peer are
out at once: a burst of pulls (64 hand-overs at once) queues for an endpoint instead of opening
64 connections together, whose handshakes on a loaded host ran past the connect timeout.

A failure with a peer (a discarded endpoint, a failed connect) retires every endpoint to that
peer made before it, in every pool of the process (they share the failed link); retired
endpoints are aborted and parked (frames.park), never freed under UCX. A connect the caller
stops waiting for is left to end on its own (`_abandon`): cancelling ucxx's handshake freed
buffers UCX still wrote into once the link came back, and the decode worker died with SIGSEGV
on its next pull (tests/multihost: about 1 run in 3 of the prefill link-down test before).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from splitserve.kvtransfer import frames
from splitserve.kvtransfer.errors import KvTransferError
from splitserve.kvtransfer.progress_wait import BOOST

MAX_PER_PEER = 16
_FAILED_AT: dict[tuple[str, int], float] = {}  # peer -> monotonic time of its last failure


HANDSHAKE_LIMIT_S = 86400.0  # ucxx's own connect timeout: in effect none (see _connect_or_reuse)
_ABANDONED: set[asyncio.Future] = set()  # connects nobody waits for: kept until they end


def _abandon(connect: asyncio.Future) -> None:
    """A connect the caller stopped waiting for: kept referenced until it ends; an endpoint it
    still makes is retired."""
    if connect.done():
        if not connect.cancelled():
            connect.exception()  # retrieved: a refused connect is the caller's error already
        return
    _ABANDONED.add(connect)

    def ended(fut: asyncio.Future) -> None:
        _ABANDONED.discard(fut)
        if not fut.cancelled() and fut.exception() is None:
            _retire(fut.result())

    connect.add_done_callback(ended)


def _retire(ep) -> None:
    ep.abort()
    frames.park(ep)  # UCX may still report the connection's end to it: never free it under UCX


class EndpointPool:
    def __init__(self, connect_timeout_s: float, max_per_peer: int = MAX_PER_PEER) -> None:
        self.timeout = connect_timeout_s
        self.idle: dict[tuple[str, int], list] = defaultdict(list)  # (endpoint, made at)
        self._made: dict[int, float] = {}  # id(endpoint) -> when it connected
        self._slots: dict[tuple[str, int], asyncio.Semaphore] = {}
        self.max_per_peer = max_per_peer

    def _slot(self, key: tuple[str, int]) -> asyncio.Semaphore:
        if key not in self._slots:
            self._slots[key] = asyncio.Semaphore(self.max_per_peer)
        return self._slots[key]

    async def acquire(self, host: str, port: int, fresh: bool = False):
        """(endpoint, reused): an idle cached endpoint, else a new connection. Every acquired
        endpoint goes back through `release` or `discard` (`fresh`: the caller discarded one
        and replaces it, holding on to its slot)."""
        key = (host, port)
        if not fresh:
            await self._slot(key).acquire()
        try:
            return await self._connect_or_reuse(key, fresh)
        except BaseException:
            self._slot(key).release()
            raise

    async def _connect_or_reuse(self, key: tuple[str, int], fresh: bool):
        idle = self.idle[key]
        failed_at = _FAILED_AT.get(key, float("-inf"))
        while idle and not fresh:
            ep, made = idle.pop()
            if made < failed_at:  # made before the peer's last failure: on the failed link
                _retire(ep)
            elif not ep.closed:
                return ep, True
        import ucxx

        host, port = key
        # never time the connect out inside ucxx: its handshake's timeout leaves the posted
        # peer-info send / receive behind, with buffers freed, and a link that comes back
        # later delivers into them (a decode worker crashed with SIGSEGV on the next pull).
        # The caller stops waiting after `timeout`; the handshake itself is left to finish
        # or fail (`_abandon`)
        connect = asyncio.ensure_future(
            ucxx.create_endpoint(host, port, connect_timeout=HANDSHAKE_LIMIT_S)
        )
        try:
            ep = await asyncio.wait_for(asyncio.shield(connect), self.timeout)
            self._made[id(ep)] = time.monotonic()
            return ep, False
        except BaseException as exc:  # timeout or refused: either way the peer is unreachable now
            _abandon(connect)
            if not isinstance(exc, Exception):
                raise
            _FAILED_AT[key] = time.monotonic()
            raise KvTransferError(
                "connect",
                f"cannot reach the prefill worker's UCX listener at "
                f"{host}:{port}: {exc or type(exc).__name__}",
            ) from exc

    def release(self, host: str, port: int, ep) -> None:
        made = self._made.get(id(ep), float("-inf"))
        if not ep.closed:
            self.idle[(host, port)].append((ep, made))
        else:
            self._made.pop(id(ep), None)
        self._slot((host, port)).release()

    def discard(self, host: str, port: int, ep, keep_slot: bool = False) -> None:
        """Retires a failed endpoint and every older one to its peer (module doc);
        `keep_slot`: its replacement is acquired with fresh=True."""
        key = (host, port)
        _FAILED_AT[key] = time.monotonic()
        self._made.pop(id(ep), None)
        _retire(ep)
        for old, _ in self.idle.pop(key, []):
            self._made.pop(id(old), None)
            _retire(old)
        if not keep_slot:
            self._slot(key).release()

    def close(self) -> None:
        for eps in self.idle.values():
            for ep, _ in eps:
                ep.abort()
        self.idle.clear()
        self._made.clear()
        BOOST.rest_now()  # the owner's loop may end before the polling linger does
