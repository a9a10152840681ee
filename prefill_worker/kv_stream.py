"""The prefill engine's side of streamed hand-overs (kvtransfer/layer_stream_server.py): which
pieces of a request's KV are ready to go, fed to the decode worker attached to it.

    engine loop (this hub, loop thread)                   step thread
    before_step: attached requests catch up to their      runner.prefill: after layer group
                 chunk's start (prefix-cache hits first)  g's KV write, on_layer_kv records a
    group_ready(g, event) ◀── call_soon_threadsafe ────── CUDA event (CPU: the write is done)
                 each attached chunk's blocks, layers of g
    after_step / finished: the final message (first token, lease) or ABORTED on an abort

A decode worker may attach before the Prefill call arrives (it waits for it), while the prompt
is queued or computing (catch-up, then live pieces) or after it finished (everything from the
lease, then the final message). Pieces are snapshots of block ids: the blocks stay owned by the
sequence, then by its lease, until the decode side confirms (then the lease is released).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.layer_stream_server import LayerStreamSender, StreamEnd, StreamPiece
from splitserve.kvtransfer.server import LeaseLookupError
from splitserve.protos import kv_pb2


@dataclass(eq=False)
class Feed:
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent_tokens: int = 0  # prompt tokens whose KV (all layers) is queued
    ended: bool = False

    head: StreamPiece | StreamEnd | None = None  # taken by the sender and given back

    async def next(self, timeout: float) -> StreamPiece | StreamEnd:
        item = self.next_nowait()
        return item if item is not None else await asyncio.wait_for(self.queue.get(), timeout)

    def next_nowait(self) -> StreamPiece | StreamEnd | None:
        if self.head is not None:
            item, self.head = self.head, None
            return item
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def unget(self, item: StreamPiece | StreamEnd) -> None:
        """Gives back the item just taken (it comes next): dropped with the queue by lease_gone,
        so an end the sender looked at cannot overtake the ABORTED that replaces it."""
        self.head = item

    def drop_queued(self) -> None:
        self.head = None
        while not self.queue.empty():
            self.queue.get_nowait()

    def end(self, end: StreamEnd) -> None:
        if not self.ended:
            self.ended = True
            self.queue.put_nowait(end)


class StreamHub:
    """Loop thread only (the engine's event loop), except `on_layer_kv` (the step thread)."""

    def __init__(self, engine, num_layers: int, groups: int, wait_s: float) -> None:
        self.engine = engine
        self.num_layers = num_layers
        size = -(-num_layers // min(groups, num_layers))
        self.bounds = [(lo, min(lo + size, num_layers)) for lo in range(0, num_layers, size)]
        self._group_end = {hi - 1: (lo, hi) for lo, hi in self.bounds}
        self.wait_s = wait_s
        self.feeds: dict[str, Feed] = {}
        self.arrived: dict[str, asyncio.Event] = {}
        # for late attaches: (its end, when, its stream token, its lease)
        self.done: OrderedDict[str, tuple[StreamEnd, float, str, str]] = OrderedDict()
        self._step: list = []  # the step in flight: (seq, start, end, block ids)
        self._groups_done: list[tuple[int, int, object]] = []
        self._loop = asyncio.get_running_loop()
        self.on_added = None  # the listener's expect_pull

    @property
    def block_size(self) -> int:
        return self.engine.runner.block_size

    # ---- the listener (layer_stream_server.StreamSource) -----------------------------------------
    async def begin_stream(self, request_id: str, num_tokens: int, token: str) -> Feed:
        """`token`: the request's PrefillRequest.kv_stream_token; a wrong or missing one is
        answered like an unknown request (the request id alone is not a secret)."""
        if request_id in self.feeds:
            raise LeaseLookupError(
                kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN, "this request is already being streamed"
            )
        seq = self.engine.scheduler.find(request_id)
        if seq is None and request_id not in self.done:  # the Prefill call may still be on its way
            event = self.arrived.setdefault(request_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), self.wait_s)
            except TimeoutError:
                raise LeaseLookupError(
                    kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN,
                    f"no request {request_id!r} arrived within {self.wait_s:g}s",
                ) from None
            finally:
                self.arrived.pop(request_id, None)
            seq = self.engine.scheduler.find(request_id)
        feed = Feed(request_id)
        if seq is not None:
            _check_token(seq.stream_token, token)
            if len(seq.prompt) != num_tokens:
                raise LeaseLookupError(
                    kv_pb2.KV_PULL_STATUS_INCOMPATIBLE,
                    f"the request's prompt has {len(seq.prompt)} tokens, not {num_tokens}",
                )
            self.feeds[request_id] = feed
            self.engine.metrics.stream_attach_wait_seconds.observe(
                time.perf_counter() - seq.first_kv_at if seq.first_kv_at else 0.0
            )
            self._catch_up(feed, seq.block_table, seq.num_computed)
            for lo, hi, event in self._groups_done:  # attached mid-step: its groups so far
                self._queue_step_groups(feed, lo, hi, event)
            return feed
        end, at, expected, lease_id = self.done.get(request_id, (None, 0.0, "", ""))
        _check_token(expected, token)
        lease = self.engine.leases.get(lease_id) if end is not None else None
        if lease is None or lease.num_tokens != num_tokens:
            raise LeaseLookupError(
                kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN,
                "the request finished and its KV is gone (released, aborted or expired)",
            )
        self.feeds[request_id] = feed
        self.engine.metrics.stream_attach_wait_seconds.observe(time.perf_counter() - at)
        self._catch_up(feed, lease.block_ids, lease.num_tokens)
        feed.end(end)
        return feed

    def end_stream(self, request_id: str, lease_id: str, delivered: bool) -> None:
        self.feeds.pop(request_id, None)
        if delivered:
            self.done.pop(request_id, None)
            if self.engine.leases.get(lease_id) is not None:
                self.engine.release_lease(lease_id)

    # ---- the engine ------------------------------------------------------------------------------
    def added(self, request_id: str) -> None:
        if (event := self.arrived.get(request_id)) is not None:
            event.set()
        if self.on_added is not None:  # idle KV endpoints: a streamed pull may come now
            self.on_added()

    def before_step(self, batch) -> None:
        self._groups_done = []
        self._step = [(c.seq, c.start, c.end, tuple(c.seq.block_table)) for c in batch]
        for seq, start, _, table in self._step:
            if (feed := self.feeds.get(seq.request_id)) is not None:
                self._catch_up(feed, table, start)  # prefix-cache hits, or chunks before attach

    def on_layer_kv(self, layer: int) -> None:
        """Step thread, after layer `layer`'s KV write was issued."""
        group = self._group_end.get(layer)
        if group is None:
            return
        event = None
        if self.engine.runner.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._loop.call_soon_threadsafe(self._group_ready, *group, event)

    def _group_ready(self, lo: int, hi: int, event) -> None:
        self._groups_done.append((lo, hi, event))
        for seq, *_ in self._step:
            if (feed := self.feeds.get(seq.request_id)) is not None:
                self._queue_step_groups(feed, lo, hi, event, only=seq)

    def after_step(self) -> None:
        now = time.perf_counter()
        for seq, _, end, _ in self._step:
            seq.first_kv_at = seq.first_kv_at or now
            if (feed := self.feeds.get(seq.request_id)) is not None and not feed.ended:
                feed.sent_tokens = max(feed.sent_tokens, end)
        self._step, self._groups_done = [], []

    def finished(self, seq, result) -> None:
        """`seq`'s prompt is done: the final message (first token, lease) for its decode side."""
        if result.lease is None:
            end = StreamEnd(
                kv_pb2.KV_PULL_STATUS_OK, first_token_id=result.first_token_id, finished=True
            )
        else:
            end = StreamEnd(
                kv_pb2.KV_PULL_STATUS_OK,
                first_token_id=result.first_token_id,
                lease_id=result.lease.lease_id,
            )
            self._remember(seq.request_id, end, seq.stream_token, end.lease_id)
        if (feed := self.feeds.get(seq.request_id)) is not None:
            feed.end(end)

    def aborted(self, request_id: str, why: str) -> None:
        self.done.pop(request_id, None)
        if (feed := self.feeds.get(request_id)) is not None:
            feed.end(StreamEnd(kv_pb2.KV_PULL_STATUS_ABORTED, message=why))

    def lease_gone(self, request_id: str, why: str = "the lease was dropped") -> None:
        """The request's lease was dropped (expired, released, aborted) while its stream may
        still be sending: its queued pieces name freed blocks, so they are dropped and the
        stream ends ABORTED (the decode side discards what it landed) instead of OK."""
        self.done.pop(request_id, None)
        feed = self.feeds.get(request_id)
        if feed is None:
            return
        feed.drop_queued()
        feed.ended = False
        feed.end(StreamEnd(kv_pb2.KV_PULL_STATUS_ABORTED, message=why))

    # ---- pieces ----------------------------------------------------------------------------------
    def _catch_up(self, feed: Feed, table, upto: int) -> None:
        if upto > feed.sent_tokens:
            b0, b1 = feed.sent_tokens // self.block_size, -(-upto // self.block_size)
            feed.queue.put_nowait(StreamPiece(0, self.num_layers, b0, b1, tuple(table[b0:b1])))
            feed.sent_tokens = upto

    def _queue_step_groups(self, feed: Feed, lo: int, hi: int, event, only=None) -> None:
        for seq, start, end, table in self._step:
            if seq.request_id != feed.request_id or (only is not None and seq is not only):
                continue
            if feed.ended or feed.sent_tokens < start:
                continue
            b0, b1 = start // self.block_size, -(-end // self.block_size)
            feed.queue.put_nowait(StreamPiece(lo, hi, b0, b1, table[b0:b1], event))

    def _remember(self, request_id: str, end: StreamEnd, token: str, lease_id: str) -> None:
        self.done[request_id] = (end, time.perf_counter(), token, lease_id)
        leases = self.engine.leases  # oldest first: drop those whose lease is gone
        while len(self.done) > 4096 or leases.get(next(iter(self.done.values()))[3]) is None:
            self.done.popitem(last=False)


def _check_token(expected: str, given: str) -> None:
    if not expected or not secrets.compare_digest(expected.encode(), given.encode()):
        raise LeaseLookupError(
            kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN,
            "no streamable request with this id and token on this prefill worker",
        )


def attach_stream_hub(
    engine, kv_server, cfg: KvTransferConfig, spec: PoolSpec, hub_cls=StreamHub, **kw
) -> StreamHub:
    """Turns streamed hand-overs on for a started engine and its listener (after warm-up, so the
    layer hook never fires inside it); `hub_cls`: MirroredStreamHub on rank 0 of a tensor-parallel
    worker (kv_stream_tp.py)."""
    runner = engine.runner
    hub = hub_cls(
        engine,
        runner.model_config.num_hidden_layers,
        cfg.stream_layer_groups,
        cfg.lease_request_timeout_s,
        **kw,
    )
    engine.stream_hub = hub
    serve_hub(hub, runner, kv_server, cfg, spec, kv_server.faults.for_stream_rank(0))
    hook_layers(hub, runner)
    return hub


def serve_hub(hub: StreamHub, runner, kv_server, cfg, spec, faults) -> None:
    """`hub` feeds `kv_server`'s streamed pulls (any rank); the layer hook: hook_layers."""
    hub.on_added = kv_server.expect_pull
    kv_server.stream_sender = LayerStreamSender(
        runner.kv_cache, spec, hub, cfg, faults, kv_server.metrics
    )


def hook_layers(hub: StreamHub, runner) -> None:
    """`runner`'s forwards report each layer's KV write to `hub` (after warm-up)."""
    runner.model.on_layer_kv = hub.on_layer_kv
    if runner.prefill_graphs is not None:
        runner.prefill_graphs.on_layer_kv = hub.on_layer_kv
