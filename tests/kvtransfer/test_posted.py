"""quiet_wait.post: sends and receives posted on the endpoint at once (a pull's reply header
goes out where it is built, not when a task made for it first runs) and awaited later; an
abandoned or failed one parks its buffers, since UCX may still use them. Real UCX over TCP
loopback."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from splitserve.kvtransfer import frames
from splitserve.kvtransfer.quiet_wait import post, post_frame
from splitserve.protos import kv_pb2

pytestmark = pytest.mark.timeout(120)


async def _pair():
    import ucxx

    accepted: asyncio.Queue = asyncio.Queue()

    async def on_connect(ep):
        await accepted.put(ep)
        await asyncio.Event().wait()  # held open until the test ends

    listener = ucxx.create_listener(on_connect, 0)
    client = await ucxx.create_endpoint("127.0.0.1", listener.port)
    return listener, client, await asyncio.wait_for(accepted.get(), 30)


def _parked(buffer) -> bool:
    for _, kept in frames._PARKED:
        items = [x for k in kept for x in (k if isinstance(k, list | tuple) else [k])]
        if any(x is buffer for x in items):
            return True
    return False


def test_post_sends_before_the_loop_turns_and_waits_later():
    async def main():
        listener, client, server_ep = await _pair()
        try:
            buf = frames.new_buffer()
            receive = post(server_ep, [buf], receive=True)
            sent = post_frame(client, kv_pb2.KvPullDone(lease_id="L7", ok=True))
            # posted on ucxx's endpoint already: requests, not a task that has yet to start
            assert sent.task is None and len(sent.requests) == 1
            await sent.wait(10)
            await receive.wait(10)
            assert frames.decode(buf, kv_pb2.KvPullDone).lease_id == "L7"
            receive.abandon()  # done: nothing to park
            assert not _parked(buf)
        finally:
            client.abort()
            server_ep.abort()
            listener.close()

    asyncio.run(main())


def test_a_receive_that_times_out_or_is_abandoned_parks_its_buffers():
    async def main():
        listener, client, server_ep = await _pair()
        try:
            late = np.zeros(64, np.uint8)
            with pytest.raises(TimeoutError):
                await post(server_ep, [late], receive=True).wait(0.2)
            assert _parked(late)
            never = np.zeros(64, np.uint8)
            post(server_ep, [never], receive=True, tag=99).abandon()
            assert _parked(never)
        finally:
            client.abort()
            server_ep.abort()
            listener.close()

    asyncio.run(main())


def test_a_message_that_came_before_the_endpoint_failed_is_still_received():
    """As ucxx's own recv: a streamed request's last piece may be in before its prefill worker
    closed the connection."""
    from ucxx._lib_async.utils import hash64bits
    from ucxx.types import Tag

    from splitserve.kvtransfer.frames import PAYLOAD_TAG
    from splitserve.kvtransfer.quiet_wait import recv_all

    async def main():
        listener, client, server_ep = await _pair()
        try:
            msg = np.arange(256, dtype=np.uint8)
            await client.send(msg, tag=PAYLOAD_TAG)
            wire = Tag(hash64bits(server_ep._tags["msg_recv"], hash(PAYLOAD_TAG)))
            worker = server_ep._ctx.worker
            for _ in range(1000):  # (each wait ends at the event; the bound only ends a hang)
                if worker.tag_probe(wire).matched:
                    break
                await asyncio.sleep(0.005)
            client.abort()
            for _ in range(4000):
                try:
                    server_ep._ep.raise_on_error()
                except Exception:  # noqa: BLE001 - the failure is what the test waits for
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError("the peer's abort never reached this endpoint")
            buf = np.zeros(256, np.uint8)
            await recv_all(server_ep, [buf], 10, PAYLOAD_TAG)
            assert (buf == msg).all()
        finally:
            server_ep.abort()
            listener.close()

    asyncio.run(main())
