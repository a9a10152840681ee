"""A lagging stream sender merges queued pieces of consecutive layers over the same blocks into
one message (layer_stream_server.LayerStreamSender._coalesce), within max_message_bytes."""

from __future__ import annotations

import asyncio

import torch

from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.layer_stream_server import LayerStreamSender, StreamEnd, StreamPiece
from splitserve.prefill_worker.kv_stream import Feed, StreamHub
from splitserve.protos import kv_pb2

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 8, 6, 4, 2, 8  # one layer of one block: 2*4*2*8*2 B = 256 B


LIMIT = 2**20


def sender() -> LayerStreamSender:
    cache = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM, dtype=torch.bfloat16)
    return LayerStreamSender(cache, None, None, KvTransferConfig(), None, None)


def piece(lo: int, hi: int, blocks=(0, 2), ids=(3, 4), event=None) -> StreamPiece:
    return StreamPiece(lo, hi, *blocks, ids, event)


def test_consecutive_layers_over_the_same_blocks_become_one_piece_with_the_last_event():
    s = sender()
    merged = s._coalesce(piece(0, 2, event="e0"), piece(2, 3, event="e1"), LIMIT)
    assert (merged.layer_start, merged.layer_end, merged.block_ids, merged.event) == (
        0, 3, (3, 4), "e1"
    )  # fmt: skip


def test_pieces_that_do_not_continue_each_other_are_kept_apart():
    s = sender()
    a = piece(0, 2)
    for b in (
        piece(3, 4),  # a gap in the layers
        piece(2, 3, blocks=(2, 4), ids=(5, 6)),  # the next chunk's blocks
        piece(2, 3, event="e"),  # a live group after catch-up blocks (stream ordering differs)
        StreamEnd(0),
    ):
        assert s._coalesce(a, b, LIMIT) is None


def test_a_merged_piece_stays_within_one_message():
    per_layer = 2 * 2 * BLOCK * HEADS * DIM * 2  # two blocks, K and V
    s = sender()
    assert s._coalesce(piece(0, 2), piece(2, 3), 3 * per_layer) is not None
    assert s._coalesce(piece(0, 2), piece(2, 4), 3 * per_layer) is None


def test_what_does_not_merge_goes_back_to_the_feed_and_comes_next():

    async def run():
        feed = Feed("r")
        for item in (piece(0, 2), piece(2, 3), piece(5, 6), StreamEnd(0)):
            feed.queue.put_nowait(item)
        s = sender()
        first = s._merge_queued(feed, await feed.next(1.0), LIMIT)
        assert (first.layer_start, first.layer_end) == (0, 3)
        assert (await feed.next(1.0)).layer_start == 5  # given back, comes next
        assert s._merge_queued(feed, piece(5, 6), LIMIT) == piece(5, 6)
        assert feed.head == StreamEnd(0)  # the end, taken and given back
        assert await feed.next(1.0) == StreamEnd(0) and feed.next_nowait() is None

    asyncio.run(run())


def test_lease_gone_drops_a_given_back_end():
    """An end the sender looked at and gave back must not survive lease_gone: it would overtake
    the ABORTED while the blocks are freed."""

    async def run():
        hub = StreamHub.__new__(StreamHub)
        hub.done, feed = {}, Feed("r")
        hub.feeds = {"r": feed}
        feed.queue.put_nowait(StreamEnd(0, lease_id="L"))
        feed.ended = True
        feed.unget(await feed.next(1.0))  # the sender looked at the end and gave it back
        hub.lease_gone("r")
        return await feed.next(1.0), feed.next_nowait()

    end, nothing = asyncio.run(run())
    assert end.status == kv_pb2.KV_PULL_STATUS_ABORTED and nothing is None
