"""Control frames (kvtransfer/frames.py): the largest request a worker accepts fits one frame,
a long refusal message is cut to fit, and a malformed frame is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve.kvtransfer import frames
from splitserve.protos import kv_pb2


def _received(msg) -> np.ndarray:
    buf = frames.new_buffer()
    sent = frames.encode(msg)
    buf[: sent.size] = sent  # a shorter message lands at the start of the posted buffer
    return buf


def test_a_request_with_the_longest_request_id_round_trips():
    req = kv_pb2.KvPullRequest(lease_id="a" * 32, request_id="é" * 1024, model_compat_hash="h" * 64)
    assert frames.decode(_received(req), kv_pb2.KvPullRequest) == req


def test_a_long_reply_message_is_cut_to_fit_and_a_bad_length_is_refused():
    reply = kv_pb2.KvPullReply(status=kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN, message="ü" * 10_000)
    got = frames.decode(_received(reply), kv_pb2.KvPullReply)
    assert got.status == reply.status and got.message.endswith("...")
    bad = frames.new_buffer()
    bad[:4] = np.frombuffer((frames.FRAME_BYTES).to_bytes(4, "little"), np.uint8)
    with pytest.raises(ValueError, match="control frame"):
        frames.decode(bad, kv_pb2.KvPullReply)
