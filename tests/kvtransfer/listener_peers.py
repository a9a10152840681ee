"""Shared by the KV listener's tests (test_listener_guard.py, test_listener_quiet.py): a
listener over real UCX (TCP loopback on CPU) with a lease table, raw ucxx endpoints as its
peers, and an event loop that counts its turns."""

from __future__ import annotations

import asyncio
import contextlib

import torch

from splitserve.kvtransfer import frames
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.server import KvTransferServer, LeaseLookupError
from splitserve.protos import kv_pb2

SHAPE = (2, 2, 80, 16, 2, 64)  # 32 KiB per block (fp32)


class Leases:
    def __init__(self):
        self.table: dict[str, list[int]] = {}
        self.pulled: list[tuple[str, bool]] = []

    def begin_pull(self, lease_id, request_id):
        if lease_id not in self.table:
            raise LeaseLookupError(kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN, f"no lease {lease_id}")
        return self.table[lease_id]

    def end_pull(self, lease_id, delivered):
        self.pulled.append((lease_id, delivered))


class CountingLoop(asyncio.SelectorEventLoop):
    """Counts its turns: a coroutine polling every turn shows as thousands per second."""

    turns = 0

    def _run_once(self):
        self.turns += 1
        super()._run_once()


def run(coro):
    with asyncio.Runner(loop_factory=CountingLoop) as runner:
        return runner.run(coro)


async def until(predicate, what: str, limit: float = 30.0) -> None:
    """Waits for an event; `limit` only ends a test that would otherwise hang."""
    for _ in range(int(limit / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


@contextlib.asynccontextmanager
async def listening(cfg: KvTransferConfig, blocks=(3, 4), **kw):
    """A started listener over a random pool whose lease "L1" holds `blocks`, closed on exit:
    (server, its pool, its PoolSpec, the lease table)."""
    src = torch.randn(SHAPE)
    spec = PoolSpec.of(src, "h")
    leases = Leases()
    leases.table["L1"] = list(blocks)
    server = KvTransferServer(src, spec, leases, cfg, **kw)
    await server.start()
    try:
        yield server, src, spec, leases
    finally:
        await server.close()


async def connect(server: KvTransferServer):
    """A raw ucxx endpoint to `server`'s listener on loopback: a peer."""
    import ucxx

    return await ucxx.create_endpoint("127.0.0.1", server.port)


def request(spec: PoolSpec, lease: str = "L1", **kw) -> kv_pb2.KvPullRequest:
    return kv_pb2.KvPullRequest(lease_id=lease, request_id="r1", **spec.fields(), **kw)


async def ask(ep, req) -> kv_pb2.KvPullReply:
    """A request and its reply header (the reply's receive posted first, as client.py does)."""
    reply = asyncio.ensure_future(frames.recv(ep, kv_pb2.KvPullReply))
    await frames.send(ep, req)
    return await asyncio.wait_for(reply, 30)
