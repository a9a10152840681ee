"""What a peer of the KV listener may do (kvtransfer/connections.py, idle_watch.py,
bound_listener.py, quiet_wait.py), over real UCX (TCP loopback on CPU), with raw ucxx endpoints
as the misbehaving peers: the listener binds the worker's host only; a connection without a
request, with junk, refused, idle or sending active messages is closed; at max_connections the
longest idle one makes room; many idle endpoints cost one probe per loop turn; strays are
dropped; a tiny max_message_bytes is floored; a peer that never reads leaves the loop quiet."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from splitserve.kvtransfer import frames
from splitserve.kvtransfer import server as server_mod
from splitserve.kvtransfer.client import KvTransferClient
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.descriptor import PoolSpec, make_handle
from splitserve.kvtransfer.server import KvTransferServer, LeaseLookupError, TransferFaults
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


async def start(cfg: KvTransferConfig, blocks=(3, 4), **kw):
    src = torch.randn(SHAPE)
    spec = PoolSpec.of(src, "h")
    leases = Leases()
    leases.table["L1"] = list(blocks)
    server = KvTransferServer(src, spec, leases, cfg, **kw)
    await server.start()
    return server, src, spec, leases


def request(spec: PoolSpec, lease: str = "L1", **kw) -> kv_pb2.KvPullRequest:
    return kv_pb2.KvPullRequest(lease_id=lease, request_id="r1", **spec.fields(), **kw)


async def ask(ep, req) -> kv_pb2.KvPullReply:
    """A request and its reply header (the reply's receive posted first, as client.py does)."""
    reply = asyncio.ensure_future(frames.recv(ep, kv_pb2.KvPullReply))
    await frames.send(ep, req)
    return await asyncio.wait_for(reply, 30)


def listening_addresses(port: int) -> set[str]:
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.split(":")
                if state == "0A" and int(p, 16) == port:
                    found.add("0.0.0.0" if set(addr) == {"0"} else addr[:width])
    return found


@pytest.mark.parametrize(
    ("host", "listen_host", "bound"),
    [
        ("127.0.0.1", None, {"0100007F"}),
        ("0.0.0.0", None, {"0.0.0.0"}),
        (None, None, {"0.0.0.0"}),
        ("0.0.0.0", "127.0.0.1", {"0100007F"}),
    ],
)
def test_the_listener_binds_the_workers_host_only(host, listen_host, bound):
    cfg = KvTransferConfig(listen_host=listen_host, data_timeout_s=5, lease_request_timeout_s=5)

    async def main():
        server, src, spec, leases = await start(cfg, host=host)
        port = server.port
        dst = torch.zeros(SHAPE)
        client = KvTransferClient(dst, PoolSpec.of(dst, "h"), cfg)
        try:
            assert listening_addresses(port) == bound
            handle = make_handle(
                spec, host="127.0.0.1", port=server.port, lease_id="L1", request_id="r1",
                num_blocks=2, num_tokens=20, ttl_s=30,
            )  # fmt: skip
            await client.pull(handle, [7, 8])
            assert torch.equal(dst[:, :, [7, 8]], src[:, :, [3, 4]])
        finally:
            client.close()
            await server.close()
        await until(lambda: not listening_addresses(port), "the port closed")

    run(main())


def test_connections_without_a_valid_request_or_refused_are_closed():
    import ucxx

    cfg = KvTransferConfig(lease_request_timeout_s=0.5, data_timeout_s=5)

    async def main():
        server, _, spec, _ = await start(cfg)
        closed = server.connections.closed
        try:
            silent = await ucxx.create_endpoint("127.0.0.1", server.port)
            junk = await ucxx.create_endpoint("127.0.0.1", server.port)
            await junk.send(np.full(64, 0xFF, np.uint8))  # no KvPullRequest frame
            refused = await ucxx.create_endpoint("127.0.0.1", server.port)
            reply = await ask(refused, request(spec, lease="nobody's"))
            assert reply.status == kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN
            await until(lambda: len(server.connections) == 0, "every connection closed")
            assert closed == {"no request": 1, "malformed request": 1, "refused": 1}, closed
            # their peers see it (the refused one kept its endpoint: the listener closed it)
            await until(lambda: silent.closed and junk.closed and refused.closed, "peers closed")
        finally:
            await server.close()

    run(main())


def test_active_messages_close_the_endpoint():
    import ucxx

    cfg = KvTransferConfig(lease_request_timeout_s=30)

    async def main():
        server, _, _, _ = await start(cfg)
        try:
            ep = await ucxx.create_endpoint("127.0.0.1", server.port)
            with pytest.raises(Exception, match="reset"):  # closed on the listener's next scan
                for _ in range(100_000):
                    await ep.am_send(np.ones(1024, np.uint8))
            await until(lambda: server.connections.closed.get("active messages"), "closed")
        finally:
            await server.close()

    run(main())


def test_idle_endpoints_are_closed_and_the_decode_pool_connects_anew():
    cfg = KvTransferConfig(idle_timeout_s=0.3, data_timeout_s=5, lease_request_timeout_s=5)

    async def main():
        server, src, spec, leases = await start(cfg)
        dst = torch.zeros(SHAPE)
        client = KvTransferClient(dst, PoolSpec.of(dst, "h"), cfg)
        try:
            for i, lease in enumerate(("A", "B", "C")):
                leases.table[lease] = [10 + i]
                handle = make_handle(
                    spec, host="127.0.0.1", port=server.port, lease_id=lease, request_id="r",
                    num_blocks=1, num_tokens=10, ttl_s=30,
                )  # fmt: skip
                await client.pull(handle, [20 + i])
                assert torch.equal(dst[:, :, 20 + i], src[:, :, 10 + i])
                # the endpoint back in the pool, then closed by the listener while idle
                await until(lambda i=i: server.connections.closed.get("idle", 0) > i, "idle close")
        finally:
            client.close()
            await server.close()

    run(main())


def test_at_max_connections_the_longest_idle_makes_room_and_busy_ones_stay():
    import ucxx

    cfg = KvTransferConfig(max_connections=2, lease_request_timeout_s=30, data_timeout_s=30)

    async def main():
        faults = TransferFaults(stall_before_payload_s=1.0)  # the pull stays busy meanwhile
        server, src, spec, leases = await start(cfg, faults=faults)
        conns = server.connections
        try:
            first = await ucxx.create_endpoint("127.0.0.1", server.port)
            await until(lambda: len(conns) == 1, "first accepted")
            second = await ucxx.create_endpoint("127.0.0.1", server.port)
            await until(lambda: len(conns) == 2, "second accepted")
            third = await ucxx.create_endpoint("127.0.0.1", server.port)
            await until(lambda: conns.closed.get("evicted") == 1, "the oldest replaced")
            await until(lambda: first.closed, "the oldest's peer sees it")
            assert len(conns) == 2 and not second.closed and not third.closed
            second.abort()
            await until(lambda: len(conns) == 1, "second gone")
            # one busy pull and one idle connection: a newcomer replaces the idle one only
            reply = asyncio.ensure_future(ask(third, request(spec)))
            await until(lambda: any(c.state == "busy" for c in conns.handlers.values()), "busy")
            dst = torch.zeros(SHAPE)
            client = KvTransferClient(dst, PoolSpec.of(dst, "h"), cfg)
            leases.table["L2"] = [5]
            handle = make_handle(
                spec, host="127.0.0.1", port=server.port, lease_id="L2", request_id="r2",
                num_blocks=1, num_tokens=10, ttl_s=30,
            )  # fmt: skip
            other = await ucxx.create_endpoint("127.0.0.1", server.port)  # idle
            await until(lambda: len(conns) == 2, "idle one accepted")
            pull = asyncio.ensure_future(client.pull(handle, [9]))  # replaces the idle one
            await until(lambda: conns.closed.get("evicted") == 2 and other.closed, "replaced")
            late = await ucxx.create_endpoint("127.0.0.1", server.port)  # both busy: refused
            await until(lambda: conns.closed.get("full") == 1 and late.closed, "refused")
            assert (await reply).status == kv_pb2.KV_PULL_STATUS_OK
            await pull
            assert torch.equal(dst[:, :, 9], src[:, :, 5])
            client.close()
        finally:
            await server.close()

    run(main())


def test_many_idle_endpoints_cost_one_probe_per_loop_turn():
    import ucxx

    cfg = KvTransferConfig(lease_request_timeout_s=60, data_timeout_s=5)

    async def main():
        # (strays left by earlier tests would hide the idle endpoints' messages: dropped)
        server, src, spec, leases = await start(cfg, drain_strays=True)
        watch = server.connections.watch
        try:
            eps = [await ucxx.create_endpoint("127.0.0.1", server.port) for _ in range(40)]
            await until(lambda: watch.idle == 40, "40 idle endpoints")
            loop = asyncio.get_running_loop()
            server.expect_pull()  # a grant: every idle endpoint hot (probed each loop turn)
            await asyncio.sleep(0.005)
            probes, turns = watch.probes, loop.turns
            for _ in range(200):
                await asyncio.sleep(0)
            # one task probes for all of them (a probe per endpoint per turn before)
            assert watch.probes - probes <= (loop.turns - turns) + 2
            # and a request on any of them is still found
            reply = await ask(eps[17], request(spec))
            assert reply.status == kv_pb2.KV_PULL_STATUS_OK and watch.idle == 39
            for ep in eps:
                ep.abort()
        finally:
            await server.close()

    run(main())


def test_stray_messages_are_dropped():
    import ucxx
    from ucxx.types import Tag, TagMask

    cfg = KvTransferConfig(lease_request_timeout_s=0.5)

    async def main():
        server, _, _, _ = await start(cfg, drain_strays=True)
        worker = ucxx.core._get_ctx().worker
        try:
            ep = await ucxx.create_endpoint("127.0.0.1", server.port)
            msg = np.full(1024, 7, np.uint8)
            for i in range(300):  # on tags nobody receives: UCX would keep them for good
                await ep.send(msg, tag=0xDEAD)
                await ep.send(msg, tag=frames.PAYLOAD_TAG)
                await ep.send(msg, tag=0xBEEF + i, force_tag=True)
            await until(lambda: server.connections.closed.get("no request"), "closed")
            await until(lambda: not worker.tag_probe(Tag(0), TagMask(0)).matched, "drained")
            assert server.connections.watch.drained >= 900
        finally:
            await server.close()

    run(main())


def test_a_request_sent_before_the_listener_knows_its_endpoint_is_no_stray(monkeypatch):
    import ucxx

    from splitserve.kvtransfer.connections import Connections

    run_connection = Connections.run

    async def late(self, ep, serve):  # the handler starts after the peer's request arrived
        await asyncio.sleep(0.3)
        await run_connection(self, ep, serve)

    monkeypatch.setattr(Connections, "run", late)
    cfg = KvTransferConfig(lease_request_timeout_s=30, data_timeout_s=5)

    async def main():
        server, _, spec, _ = await start(cfg, drain_strays=True)
        try:
            idle = await ucxx.create_endpoint("127.0.0.1", server.port)  # the watch runs
            await until(lambda: server.connections.watch.idle == 1, "one idle endpoint")
            ep = await ucxx.create_endpoint("127.0.0.1", server.port)
            reply = await ask(ep, request(spec))
            assert reply.status == kv_pb2.KV_PULL_STATUS_OK
            idle.abort()
            ep.abort()
        finally:
            await server.close()

    run(main())


def test_a_tiny_message_size_is_floored_and_messages_are_bounded(monkeypatch):
    import ucxx

    assert KvTransferConfig().message_limit(1) == 2**20
    cfg = KvTransferConfig(max_message_bytes=2**20, data_timeout_s=5, lease_request_timeout_s=5)

    async def main():
        server, src, spec, leases = await start(cfg, blocks=tuple(range(2, 66)))  # 2 MiB
        try:
            for cap, expected in ((server_mod.MAX_MESSAGES, 2), (1, 1)):
                monkeypatch.setattr(server_mod, "MAX_MESSAGES", cap)
                ep = await ucxx.create_endpoint("127.0.0.1", server.port)
                reply = await ask(ep, request(spec, max_message_bytes=1))
                assert reply.status == kv_pb2.KV_PULL_STATUS_OK
                assert reply.num_messages == expected and reply.payload_bytes == 2 * 2**20
                ep.abort()
        finally:
            await server.close()

    run(main())


@pytest.mark.parametrize("reads_payload", [False, True])
def test_a_peer_that_never_reads_or_never_confirms_leaves_the_loop_quiet(reads_payload):
    import ucxx

    cfg = KvTransferConfig(data_timeout_s=2.5, lease_request_timeout_s=5)

    async def main():
        server, src, spec, leases = await start(cfg, blocks=tuple(range(2, 66)))  # 2 MiB
        loop = asyncio.get_running_loop()
        try:
            ep = await ucxx.create_endpoint("127.0.0.1", server.port)
            reply = await ask(ep, request(spec))
            if reads_payload:  # then the trailer, but never KvPullDone
                payload = np.empty(reply.payload_bytes, np.uint8)
                pieces = np.array_split(payload, reply.num_messages)
                await asyncio.gather(*(ep.recv(p, tag=frames.PAYLOAD_TAG) for p in pieces))
                await frames.recv(ep, kv_pb2.KvPullReply)
            await asyncio.sleep(0.5)  # past the first moments, when the listener polls
            turns = loop.turns
            await asyncio.sleep(1.0)
            # the listener waits for the payload's sends (or KvPullDone) with sleeps: about a
            # hundred turns a second, where polling every turn made tens of thousands
            assert loop.turns - turns < 2000, loop.turns - turns
            await until(lambda: leases.pulled, "the pull's end")
            assert leases.pulled == [("L1", False)]  # timed out: the blocks were unpinned
            ep.abort()
        finally:
            await server.close()

    run(main())
