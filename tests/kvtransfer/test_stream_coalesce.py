"""A lagging stream sender merges queued pieces of consecutive layers over the same blocks into
one message (layer_stream_server.LayerStreamSender._coalesce), within max_message_bytes."""

from __future__ import annotations

import torch

from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.layer_stream_server import LayerStreamSender, StreamEnd, StreamPiece

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 8, 6, 4, 2, 8  # one layer of one block: 2*4*2*8*2 B = 256 B


def sender(max_message_bytes: int = 2**20) -> LayerStreamSender:
    cache = torch.zeros(LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM, dtype=torch.bfloat16)
    cfg = KvTransferConfig(max_message_bytes=max_message_bytes)
    return LayerStreamSender(cache, None, None, cfg, None, None)


def piece(lo: int, hi: int, blocks=(0, 2), ids=(3, 4), event=None) -> StreamPiece:
    return StreamPiece(lo, hi, *blocks, ids, event)


def test_consecutive_layers_over_the_same_blocks_become_one_piece_with_the_last_event():
    s = sender()
    merged, held = s._coalesce(piece(0, 2, event="e0"), piece(2, 3, event="e1"))
    assert held is None
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
        assert s._coalesce(a, b) == (a, b)


def test_a_merged_piece_stays_within_one_message():
    per_layer = 2 * 2 * BLOCK * HEADS * DIM * 2  # two blocks, K and V
    s = sender(max_message_bytes=2**20)
    s.config = s.config.model_copy(update={"max_message_bytes": 3 * per_layer})
    assert s._coalesce(piece(0, 2), piece(2, 3))[1] is None
    a, b = piece(0, 2), piece(2, 4)
    assert s._coalesce(a, b) == (a, b)
