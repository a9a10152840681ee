"""A tensor-parallel follower's stream hub in process (no UCX, no ranks): driven by rank 0's
stream commands as its command thread would hand them over, it queues the same pieces as rank
0's hub would (every layer of every block; a prefix-cache hit's blocks first, also for a stream
that attaches in the middle of the step), ends with its own final marker (no first token, no
lease), serves a late attach from the mirrored lease, and drops queued pieces when rank 0 ends
the request."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from prefill_helpers import drain_stream, stream_coverage

from splitserve.kvtransfer.server import LeaseLookupError
from splitserve.prefill_worker.kv_stream_tp import FollowerStreamHub
from splitserve.prefill_worker.tp_follower import MirrorLeaseSource
from splitserve.protos import kv_pb2

LAYERS, TOKEN = 3, "secret"


def _hub():
    runner = SimpleNamespace(
        block_size=4,
        device=torch.device("cpu"),
        model_config=SimpleNamespace(num_hidden_layers=LAYERS),
    )
    cfg = SimpleNamespace(
        kv_transfer=SimpleNamespace(stream_layer_groups=64, lease_request_timeout_s=5.0)
    )
    leases = MirrorLeaseSource()
    return FollowerStreamHub(runner, leases, cfg), leases


def _step(hub, rid, start, end, table):
    """One mirrored step: its chunks, the forward's layer hooks, then 'prefill' done."""
    hub.on_step([(rid, start, end, table)])
    for layer in range(LAYERS):
        hub.on_layer_kv(layer)


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def _all(nblocks):
    return {(la, b) for la in range(LAYERS) for b in range(nblocks)}


def test_follower_hub_streams_like_rank0():
    async def body():
        hub, leases = _hub()
        table = tuple(range(10, 18))  # 30 tokens: 8 blocks
        # attached before rank 0's stream_add: it waits for it; two chunks of 16 and 14 tokens
        attach = asyncio.create_task(hub.begin_stream("a", 30, TOKEN))
        await _settle()
        hub.on_add("a", TOKEN, 30)
        await _settle()
        _step(hub, "a", 0, 16, table[:4])
        await _settle()
        hub.on_prefill_done()
        _step(hub, "a", 16, 30, table)
        await _settle()
        hub.on_prefill_done()
        leases.grant("L", "a", table)
        hub.on_end("a", 0, "L", 30, 0, "")
        pieces, end = await drain_stream(await attach)
        assert stream_coverage(pieces) == _all(8)
        assert end.status == kv_pb2.KV_PULL_STATUS_OK
        assert (end.first_token_id, end.lease_id, end.finished) == (0, "", False)
        hub.end_stream("a", "", delivered=True)

        # a prefix-cache hit of 20 tokens, attached after the step's chunks were announced and
        # its first layer written: the cached blocks first, then that step's layers
        hub.on_add("b", TOKEN, 25)
        _step(hub, "b", 20, 25, table[:7])
        await _settle()
        feed = await hub.begin_stream("b", 25, TOKEN)
        hub.on_prefill_done()
        hub.on_end("b", 0, "", 0, 1, "")  # the first token ended it: no lease
        pieces, end = await drain_stream(feed)
        assert (pieces[0].layer_start, pieces[0].layer_end, pieces[0].block_end) == (0, LAYERS, 5)
        assert stream_coverage(pieces) == _all(7)
        assert end.finished
        hub.end_stream("b", "", delivered=False)

        # attached after the prompt finished: everything from the mirrored lease
        hub.on_add("c", TOKEN, 12)
        _step(hub, "c", 0, 12, table[:3])
        await _settle()
        hub.on_prefill_done()
        leases.grant("Lc", "c", table[:3])
        hub.on_end("c", 0, "Lc", 12, 0, "")
        await _settle()
        with pytest.raises(LeaseLookupError):
            await hub.begin_stream("c", 12, "wrong token")
        pieces, end = await drain_stream(await hub.begin_stream("c", 12, TOKEN))
        assert len(pieces) == 1 and stream_coverage(pieces) == _all(3)
        assert end.status == kv_pb2.KV_PULL_STATUS_OK and not end.lease_id
        hub.end_stream("c", "", delivered=True)
        leases.drop(["Lc"])
        with pytest.raises(LeaseLookupError):  # the lease is gone on rank 0: nothing to send
            await hub.begin_stream("c", 12, TOKEN)

        # rank 0 ended the request (aborted, or its lease dropped): queued pieces dropped
        hub.on_add("d", TOKEN, 8)
        feed = await hub.begin_stream("d", 8, TOKEN)
        _step(hub, "d", 0, 8, table[:2])
        await _settle()
        hub.on_end("d", 1, "", 0, 0, "the request was aborted")
        pieces, end = await drain_stream(feed)
        assert not pieces and end.status == kv_pb2.KV_PULL_STATUS_ABORTED
        assert "aborted" in end.message
        hub.end_stream("d", "", delivered=False)
        hub.on_prefill_done()
        assert not hub.feeds and not hub.engine.seqs

    asyncio.run(body())
