"""What a peer of the KV listener may hold (kvtransfer/connections.py, bound_listener.py), over
real UCX with raw ucxx endpoints as the peers: the listener binds the worker's host only; a
connection without a request, with junk, refused, idle or sending active messages is closed; at
max_connections the longest idle one makes room; a request that arrives before the listener
knows its endpoint is served, not dropped as a stray."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from listener_peers import SHAPE, ask, connect, listening, request, run, until

from splitserve.kvtransfer.client import KvTransferClient
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.descriptor import PoolSpec, make_handle
from splitserve.kvtransfer.server import TransferFaults
from splitserve.protos import kv_pb2


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
        async with listening(cfg, host=host) as (server, src, spec, leases):
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
        await until(lambda: not listening_addresses(port), "the port closed")

    run(main())


def test_where_ucxx_cannot_bind_one_address_it_binds_every_interface_and_warns(monkeypatch, caplog):
    from splitserve.kvtransfer import bound_listener

    monkeypatch.setattr(bound_listener, "_FNS", "ucxx 9.9 is not one whose ABI was checked")
    cfg = KvTransferConfig(lease_request_timeout_s=5)

    async def main():
        async with listening(cfg, host="127.0.0.1") as (server, _, _, _):
            assert listening_addresses(server.port) == {"0.0.0.0"}

    run(main())
    assert "binds every interface, not 127.0.0.1 (ucxx 9.9" in caplog.text


LOOPBACK_PROCESS = """
import asyncio, os, torch
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.server import KvTransferServer

def listening():  # this process's listening TCP sockets: (address, port)
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            mine.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # (the listing's own)
            pass
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).readlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f"socket:[{f[9]}]" in mine:
                found.append(tuple(f[1].split(":")))
    return found

async def main():
    pool = torch.zeros(2, 2, 4, 16, 2, 64)
    server = KvTransferServer(pool, PoolSpec.of(pool, "h"), None, KvTransferConfig(),
                              host="127.0.0.1")
    await server.start()
    print(listening())
    await server.close()

asyncio.run(main())
"""


def test_a_loopback_listener_keeps_all_of_ucx_on_loopback():
    """The KV port and UCX's own TCP data ports (one per network device) of a process whose
    listener is on loopback: none on another interface."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    out = subprocess.run(
        [sys.executable, "-c", LOOPBACK_PROCESS], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    found = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's repr
    assert len(found) >= 2  # the KV listener and at least one data port
    assert {addr for addr, _ in found} == {"0100007F"}, found


def test_connections_without_a_valid_request_or_refused_are_closed():
    cfg = KvTransferConfig(lease_request_timeout_s=0.5, data_timeout_s=5)

    async def main():
        async with listening(cfg) as (server, _, spec, _):
            closed = server.connections.closed
            silent = await connect(server)
            junk = await connect(server)
            await junk.send(np.full(64, 0xFF, np.uint8))  # no KvPullRequest frame
            refused = await connect(server)
            reply = await ask(refused, request(spec, lease="nobody's"))
            assert reply.status == kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN
            await until(lambda: len(server.connections) == 0, "every connection closed")
            assert closed == {"no request": 1, "malformed request": 1, "refused": 1}, closed
            # their peers see it (the refused one kept its endpoint: the listener closed it)
            await until(lambda: silent.closed and junk.closed and refused.closed, "peers closed")

    run(main())


def test_active_messages_close_the_endpoint():
    cfg = KvTransferConfig(lease_request_timeout_s=30)

    async def main():
        async with listening(cfg) as (server, _, _, _):
            ep = await connect(server)
            with pytest.raises(Exception, match="reset"):  # closed on the listener's next scan
                for _ in range(100_000):
                    await ep.am_send(np.ones(1024, np.uint8))
            await until(lambda: server.connections.closed.get("active messages"), "closed")

    run(main())


def test_idle_endpoints_are_closed_and_the_decode_pool_connects_anew():
    cfg = KvTransferConfig(idle_timeout_s=0.3, data_timeout_s=5, lease_request_timeout_s=5)

    async def main():
        async with listening(cfg) as (server, src, spec, leases):
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
                    await until(
                        lambda i=i: server.connections.closed.get("idle", 0) > i, "idle close"
                    )
            finally:
                client.close()

    run(main())


def test_at_max_connections_the_longest_idle_makes_room_and_busy_ones_stay():
    cfg = KvTransferConfig(max_connections=2, lease_request_timeout_s=30, data_timeout_s=30)

    async def main():
        faults = TransferFaults(stall_before_payload_s=1.0)  # the pull stays busy meanwhile
        async with listening(cfg, faults=faults) as (server, src, spec, leases):
            conns = server.connections
            first = await connect(server)
            await until(lambda: len(conns) == 1, "first accepted")
            second = await connect(server)
            await until(lambda: len(conns) == 2, "second accepted")
            third = await connect(server)
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
            other = await connect(server)  # idle
            await until(lambda: len(conns) == 2, "idle one accepted")
            pull = asyncio.ensure_future(client.pull(handle, [9]))  # replaces the idle one
            await until(lambda: conns.closed.get("evicted") == 2 and other.closed, "replaced")
            late = await connect(server)  # both busy: refused
            await until(lambda: conns.closed.get("full") == 1 and late.closed, "refused")
            assert (await reply).status == kv_pb2.KV_PULL_STATUS_OK
            await pull
            assert torch.equal(dst[:, :, 9], src[:, :, 5])
            client.close()

    run(main())


def test_a_request_sent_before_the_listener_knows_its_endpoint_is_no_stray(monkeypatch):
    from splitserve.kvtransfer.connections import Connections

    run_connection = Connections.run

    async def late(self, ep, serve):  # the handler starts after the peer's request arrived
        await asyncio.sleep(0.3)
        await run_connection(self, ep, serve)

    monkeypatch.setattr(Connections, "run", late)
    cfg = KvTransferConfig(lease_request_timeout_s=30, data_timeout_s=5)

    async def main():
        async with listening(cfg, drain_strays=True) as (server, _, spec, _):
            idle = await connect(server)  # the watch runs
            await until(lambda: server.connections.watch.idle == 1, "one idle endpoint")
            ep = await connect(server)
            reply = await ask(ep, request(spec))
            assert reply.status == kv_pb2.KV_PULL_STATUS_OK
            idle.abort()
            ep.abort()

    run(main())
