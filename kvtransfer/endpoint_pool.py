"""UCX endpoints of the decode side's KV pulls, kept per prefill host:port for reuse.

`acquire` hands out an idle cached endpoint (or connects a new one, `KvTransferError("connect")`
when the peer is unreachable); `release` returns a healthy one after a pull. An endpoint that
failed is aborted by its user instead of being released, so the next pull connects afresh.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from splitserve.kvtransfer.errors import KvTransferError


class EndpointPool:
    def __init__(self, connect_timeout_s: float) -> None:
        self.timeout = connect_timeout_s
        self.idle: dict[tuple[str, int], list] = defaultdict(list)

    async def acquire(self, host: str, port: int, fresh: bool = False):
        """(endpoint, reused): an idle cached endpoint, else a new connection."""
        idle = self.idle[(host, port)]
        while idle and not fresh:
            ep = idle.pop()
            if not ep.closed:
                return ep, True
        import ucxx

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

    def close(self) -> None:
        for eps in self.idle.values():
            for ep in eps:
                ep.abort()
        self.idle.clear()
