"""A streamed piece's header and payload are posted on the endpoint at once
(layer_stream_server._send_piece); a stream that fails before the task awaiting them ran its
first step must still park them (frames.park), since UCX may read them until the endpoint's
abort ends. Real UCX over TCP loopback."""

from __future__ import annotations

import asyncio

import pytest
import torch

from splitserve.kvtransfer import frames
from splitserve.kvtransfer.config import KvTransferConfig, TransferFaults
from splitserve.kvtransfer.layer_stream_server import LayerStreamSender, StreamPiece
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.protos import kv_pb2

pytestmark = pytest.mark.timeout(120)


class _Feed:
    """Pieces already queued: the sender takes the next without yielding to the loop."""

    def __init__(self, items):
        self.items, self.head = list(items), None

    async def next(self, timeout):
        item = self.next_nowait()
        if item is None:
            await asyncio.sleep(timeout)
        return item

    def next_nowait(self):
        if self.head is not None:
            item, self.head = self.head, None
            return item
        return self.items.pop(0) if self.items else None

    def unget(self, item):
        self.head = item


def test_a_stream_broken_at_once_parks_the_pieces_it_posted(monkeypatch):
    parked = []
    monkeypatch.setattr(frames, "park", lambda *kept: parked.append(kept))

    async def main():
        import ucxx

        accepted: asyncio.Queue = asyncio.Queue()

        async def on_connect(ep):
            await accepted.put(ep)
            await asyncio.Event().wait()

        listener = ucxx.create_listener(on_connect, 0)
        client = await ucxx.create_endpoint("127.0.0.1", listener.port)
        server_ep = await asyncio.wait_for(accepted.get(), 30)
        try:
            kv = torch.randn(4, 2, 8, 16, 2, 64)
            # CPU: the gather's stream wait does not yield, so the fault after piece 1 raises
            # before the task holding piece 1's sends ever runs
            faults = TransferFaults(request_id_prefix="F", stream_break_after_pieces=1)
            sender = LayerStreamSender(
                kv, None, None, KvTransferConfig(), faults, KvTransferMetrics()
            )
            feed = _Feed([StreamPiece(i, i + 1, 0, 4, (0, 1, 2, 3)) for i in range(3)])
            with pytest.raises(ConnectionError, match="fault injected"):
                await sender._send_all(server_ep, kv_pb2.KvPullRequest(request_id="F1"), feed)
            await asyncio.sleep(0.05)  # the cancelled task's callbacks run
        finally:
            client.abort()
            server_ep.abort()
            listener.close()

    asyncio.run(main())
    assert len(parked) >= 2  # piece 1's header and payload, posted before the fault
