"""What the KV listener spends on its peers (kvtransfer/idle_watch.py, quiet_wait.py, server.py),
over real UCX with raw ucxx endpoints as the peers: many idle endpoints cost one probe per loop
turn; messages on tags nobody receives are dropped; a tiny max_message_bytes is floored and a
pull's messages bounded; a peer that never reads its payload, or never sends KvPullDone, leaves
the event loop asleep instead of polling every turn."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from listener_peers import ask, connect, listening, request, run, until

from splitserve.kvtransfer import frames
from splitserve.kvtransfer import server as server_mod
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.protos import kv_pb2


def test_many_idle_endpoints_cost_one_probe_per_loop_turn():
    cfg = KvTransferConfig(lease_request_timeout_s=60, data_timeout_s=5)

    async def main():
        # (strays left by earlier tests would hide the idle endpoints' messages: dropped)
        async with listening(cfg, drain_strays=True) as (server, src, spec, leases):
            watch = server.connections.watch
            eps = [await connect(server) for _ in range(40)]
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

    run(main())


def test_stray_messages_are_dropped():
    import ucxx
    from ucxx.types import Tag, TagMask

    cfg = KvTransferConfig(lease_request_timeout_s=0.5)

    async def main():
        async with listening(cfg, drain_strays=True) as (server, _, _, _):
            worker = ucxx.core._get_ctx().worker
            ep = await connect(server)
            msg = np.full(1024, 7, np.uint8)
            for i in range(300):  # on tags nobody receives: UCX would keep them for good
                await ep.send(msg, tag=0xDEAD)
                await ep.send(msg, tag=frames.PAYLOAD_TAG)
                await ep.send(msg, tag=0xBEEF + i, force_tag=True)
            await until(lambda: server.connections.closed.get("no request"), "closed")
            await until(lambda: not worker.tag_probe(Tag(0), TagMask(0)).matched, "drained")
            assert server.connections.watch.drained >= 900

    run(main())


def test_a_tiny_message_size_is_floored_and_messages_are_bounded(monkeypatch):
    assert KvTransferConfig().message_limit(1) == 2**20
    cfg = KvTransferConfig(max_message_bytes=2**20, data_timeout_s=5, lease_request_timeout_s=5)

    async def main():
        async with listening(cfg, blocks=tuple(range(2, 66))) as (server, _, spec, _):  # 2 MiB
            for cap, expected in ((server_mod.MAX_MESSAGES, 2), (1, 1)):
                monkeypatch.setattr(server_mod, "MAX_MESSAGES", cap)
                ep = await connect(server)
                reply = await ask(ep, request(spec, max_message_bytes=1))
                assert reply.status == kv_pb2.KV_PULL_STATUS_OK
                assert reply.num_messages == expected and reply.payload_bytes == 2 * 2**20
                ep.abort()

    run(main())


@pytest.mark.parametrize("reads_payload", [False, True])
def test_a_peer_that_never_reads_or_never_confirms_leaves_the_loop_quiet(reads_payload):
    cfg = KvTransferConfig(data_timeout_s=2.5, lease_request_timeout_s=5)

    async def main():
        async with listening(cfg, blocks=tuple(range(2, 66))) as (server, _, spec, leases):  # 2 MiB
            loop = asyncio.get_running_loop()
            ep = await connect(server)
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

    run(main())
