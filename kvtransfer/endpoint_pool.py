"""UCX endpoints of the decode side's KV pulls, kept per prefill host:port for reuse.

`acquire` hands out an idle cached endpoint (or connects a new one, `KvTransferError("connect")`
when the peer is unreachable); `release` returns a healthy one after a pull, `discard` aborts
one that failed (the next pull connects afresh). At most `max_per_peer` endpoints per peer are
out at once: a burst of pulls (64 hand-overs at once) queues for an endpoint instead of opening
64 connections together, whose handshakes on a loaded host ran past the connect timeout.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from splitserve.kvtransfer.errors import KvTransferError

MAX_PER_PEER = 16


class EndpointPool:
    def __init__(self, connect_timeout_s: float, max_per_peer: int = MAX_PER_PEER) -> None:
        self.timeout = connect_timeout_s
        self.idle: dict[tuple[str, int], list] = defaultdict(list)
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
        while idle and not fresh:
            ep = idle.pop()
            if not ep.closed:
                return ep, True
        import ucxx

        host, port = key
        try:
            ep = await asyncio.wait_for(
                ucxx.create_endpoint(host, port, connect_timeout=self.timeout), self.timeout + 1
            )
            return ep, False
        except Exception as exc:  # timeout or refused: either way the peer is unreachable now
            raise KvTransferError(
                "connect",
                f"cannot reach the prefill worker's UCX listener at "
                f"{host}:{port}: {exc or type(exc).__name__}",
            ) from exc

    def release(self, host: str, port: int, ep) -> None:
        if not ep.closed:
            self.idle[(host, port)].append(ep)
        self._slot((host, port)).release()

    def discard(self, host: str, port: int, ep, keep_slot: bool = False) -> None:
        """Aborts a failed endpoint; `keep_slot`: its replacement is acquired with fresh=True."""
        ep.abort()
        if not keep_slot:
            self._slot((host, port)).release()

    def close(self) -> None:
        for eps in self.idle.values():
            for ep in eps:
                ep.abort()
        self.idle.clear()
