"""Prefill side of a streamed pull: the KV of a request that is still being prefilled, sent
layer group by layer group as the prefill writes it (the first token rides in the last message).

    decode worker (layer_stream_client.py)          prefill listener (this module)
    ──────────────────────────────────────          ──────────────────────────────
    reserve the prompt's blocks (waits while full)
    KvPullRequest(stream, request, num_tokens, ────▶ check geometry + hash; attach to the request
                  geometry, hash)                    (queued, prefilling, or done and leased;
                                                      not yet arrived: waits for it)
                                     ◀────────────── KvPullReply(OK)
                                                     already computed (prefix-cache hits first):
    land each piece in its blocks ◀═ KvStreamPiece + payload   all layers of those blocks
                                                     each step of this request's chunk: after
                                  ◀═ KvStreamPiece + payload   layer group g's KV write (a CUDA
                                     ...                       event; on CPU its completion),
                                                               g's K and V of the chunk's blocks
                                  ◀─ KvStreamPiece(final, first token, lease)   prompt done
    first decode step may run
    KvPullDone(ok) ────────────────────────────────▶ release the lease (blocks freed or cached)

Pieces that queue up while the sender lags (its loop thread starved by a long prefill's kernel
launches, a slow link) go as one: consecutive layers over the same blocks are merged into one
gather and one message, within max_message_bytes; a payload's completion is not awaited before
the next piece goes (at most PAYLOADS_IN_FLIGHT gathered copies alive).

A request aborted or failed on the prefill side ends the stream with a final piece of status
ABORTED; a decode side that goes away leaves the lease to the router (ReleaseLease) or its TTL.
The listener (server.py) hands a KvPullRequest with `stream` set to `serve_stream`.

Tensor parallel (prefill_worker/kv_stream_tp.py, layer_stream_shards.py): every rank's listener
serves the same sequence for its own KV heads, fed by its own forward. A follower rank's final
piece is OK without first token or lease, and its KvPullDone releases nothing; the decode side
sends rank 0's KvPullDone only once every rank's stream landed:

    decode worker                        rank 1 listener          rank 0 listener
    KvPullRequest(stream) to every rank ─▶ attach                ─▶ attach
                    ◀═ pieces of heads [h,2h) ═╡      ◀═ pieces of heads [0,h) ═╡
                    ◀─ final (OK) ─────────────┤      ◀─ final (first token, lease) ─┤
    KvPullDone ────────────────────────────────▶ (nothing to release)
    every rank landed: KvPullDone(ok) ─────────────────────────────▶ release the lease
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from splitserve.kvtransfer import frames
from splitserve.kvtransfer.buffers import TransferStream, ids_tensor, ucx_view
from splitserve.kvtransfer.checksum import payload_checksum_async, to_u64
from splitserve.kvtransfer.config import KvTransferConfig, TransferFaults
from splitserve.kvtransfer.descriptor import KvIncompatibleError, PoolSpec, check_compatible
from splitserve.kvtransfer.frames import PAYLOAD_TAG
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.kvtransfer.quiet_wait import post, post_frame, retrieve_exception, wait_all
from splitserve.protos import kv_pb2

log = logging.getLogger("splitserve.kvtransfer")

# Payload sends a stream keeps alive at once (posted, or gathered for the next piece): piece
# g+1's header and payload go out while g's send still waits for its completion (the
# receiver's ack heard by the progress thread), which takes that hop off each piece's path;
# bounded, as each holds its gathered copy.
PAYLOADS_IN_FLIGHT = 2


@dataclass(frozen=True)
class StreamPiece:
    """Layers [layer_start, layer_end) of the request's blocks [block_start, block_end), whose
    pool ids are `block_ids`; ready once `event` (a CUDA event, None on CPU) has completed."""

    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    block_ids: tuple[int, ...]
    event: object | None = None


@dataclass(frozen=True)
class StreamEnd:
    """The stream's last message: OK with the first token and the lease, or ABORTED."""

    status: int
    message: str = ""
    first_token_id: int = 0
    finished: bool = False
    lease_id: str = ""


class StreamFeed(Protocol):
    async def next(self, timeout: float) -> StreamPiece | StreamEnd:
        """The next piece to send, or the end (TimeoutError after `timeout` without one)."""

    def next_nowait(self) -> StreamPiece | StreamEnd | None:
        """The next item if one is already queued, else None."""

    def unget(self, item: StreamPiece | StreamEnd) -> None:
        """Puts back the item just taken: it comes next (unless the stream is aborted)."""


class StreamSource(Protocol):
    """The prefill engine as a streamed pull sees it (its event loop, like LeaseSource)."""

    async def begin_stream(self, request_id: str, num_tokens: int, token: str) -> StreamFeed:
        """Attaches to the request (waits for it to arrive); raises server.LeaseLookupError."""

    def end_stream(self, request_id: str, lease_id: str, delivered: bool) -> None:
        """Detaches; when delivered, releases the lease (the decode side has every block)."""


class LayerStreamSender:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        spec: PoolSpec,
        source: StreamSource,
        config: KvTransferConfig,
        faults: TransferFaults,
        metrics: KvTransferMetrics,
    ) -> None:
        self.kv_cache = kv_cache
        self.spec = spec
        self.source = source
        self.config = config
        self.faults = faults
        self.metrics = metrics
        self.stream = TransferStream(kv_cache.device)

    async def serve_stream(self, ep, req: kv_pb2.KvPullRequest, lookup_error: type) -> None:
        """One streamed pull on `ep`; a failure of the peer propagates (the endpoint is aborted)."""
        try:
            check_compatible(req, self.spec)
            feed = await self.source.begin_stream(req.request_id, req.num_tokens, req.stream_token)
        except KvIncompatibleError as exc:
            await self._reply(ep, kv_pb2.KV_PULL_STATUS_INCOMPATIBLE, str(exc))
            return
        except lookup_error as exc:
            await self._reply(ep, exc.status, str(exc))
            return
        delivered, lease_id = False, ""
        try:
            await self._reply(ep, kv_pb2.KV_PULL_STATUS_OK, "")
            delivered, lease_id = await self._send_all(ep, req, feed)
        finally:
            self.source.end_stream(req.request_id, lease_id, delivered)

    async def _reply(self, ep, status: int, message: str) -> None:
        reply = kv_pb2.KvPullReply(status=status, message=message)
        await asyncio.wait_for(frames.send(ep, reply), self.config.data_timeout_s)

    async def _send_all(self, ep, req: kv_pb2.KvPullRequest, feed: StreamFeed) -> tuple[bool, str]:
        timeout = self.config.data_timeout_s
        hit = self.faults.hits(req.request_id)
        sent = 0
        posted: deque[asyncio.Future] = deque()  # payload sends not yet complete
        try:
            with self.metrics.sending.track_inprogress():
                if hit and self.faults.stall_before_payload_s:  # tests only: a stall first
                    await asyncio.sleep(self.faults.stall_before_payload_s)
                limit = self.config.message_limit(req.max_message_bytes)
                while True:
                    item = await feed.next(timeout)
                    if hit and 0 < self.faults.stream_break_after_pieces <= sent:
                        # tests only: the prefill side dies between two pieces (or before the last)
                        raise ConnectionError("fault injected: stream broken between layer groups")
                    if isinstance(item, StreamEnd):
                        return await self._finish(ep, item, timeout, posted), item.lease_id
                    corrupt = hit and self.faults.corrupt_payload
                    while posted and (posted[0].done() or len(posted) >= PAYLOADS_IN_FLIGHT):
                        await posted.popleft()  # a failed send ends the stream before more goes
                    if not hit:  # (fault injection counts pieces)
                        item = self._merge_queued(feed, item, limit)
                    sums = not req.skip_checksum  # (the receiver verifies: checksum.py)
                    posted.append(await self._send_piece(ep, item, timeout, corrupt, sums))
                    sent += 1
        finally:
            for send in posted:  # a failed stream: its endpoint is aborted by the caller
                send.cancel()

    def _merge_queued(self, feed: StreamFeed, item: StreamPiece, limit: int) -> StreamPiece:
        """`item` with the queued pieces that continue it (see _coalesce); the first that does
        not goes back to the feed."""
        while (more := feed.next_nowait()) is not None:
            merged = self._coalesce(item, more, limit)
            if merged is None:
                feed.unget(more)
                break
            item = merged
        return item

    def _coalesce(self, a: StreamPiece, b: StreamPiece | StreamEnd, limit: int):
        """a + b when b continues a's layers over the same blocks within one message of at most
        `limit` bytes, else None. Pieces queue up when the sender lags the prefill (the loop
        thread starved, a slow link): one gather and one message then carry them all, instead
        of a round trip each; b's event follows a's on the prefill stream (all of a step's
        groups are recorded on its stream in layer order), so waiting for b covers both."""
        if not (
            isinstance(b, StreamPiece)
            and b.layer_start == a.layer_end
            and (b.block_start, b.block_end, b.block_ids)
            == (a.block_start, a.block_end, a.block_ids)
            and (a.event is None) == (b.event is None)
        ):
            return None
        per_layer = 2 * len(a.block_ids) * self.kv_cache[0, 0, 0].numel()
        if (b.layer_end - a.layer_start) * per_layer * self.kv_cache.element_size() > limit:
            return None
        return replace(a, layer_end=b.layer_end, event=b.event)

    async def _send_piece(
        self, ep, piece: StreamPiece, timeout: float, corrupt: bool, sums: bool = True
    ) -> asyncio.Future:
        """Gathers the piece and posts its header and payload (the future of their sends: the
        next piece's header need not wait for this payload's completion to be heard)."""
        stream = self.stream.stream
        if stream is not None and piece.event is None:
            self.stream.after_engine()  # computed by earlier steps, maybe still queued
        with self.stream.context():
            # from pinned memory: a pageable copy would first wait for the stream, i.e. block
            # the event loop until the group below is computed
            ids = ids_tensor(list(piece.block_ids), self.kv_cache.device)
            if stream is not None and piece.event is not None:
                stream.wait_event(piece.event)  # that group's KV write on the prefill stream
            data = self.kv_cache[piece.layer_start : piece.layer_end].index_select(2, ids)
            checksum = payload_checksum_async(data) if sums else None  # 0: not verified
        await self.stream.wait()
        payload = data.reshape(-1).view(torch.uint8)
        if corrupt:  # tests only: flipped after the checksum, like the pull's corrupt_payload
            payload[: min(64, payload.numel())] ^= 0x5A
        header = kv_pb2.KvStreamPiece(
            layer_start=piece.layer_start,
            layer_end=piece.layer_end,
            block_start=piece.block_start,
            block_end=piece.block_end,
            payload_bytes=payload.numel(),
            checksum=to_u64(checksum) if checksum is not None else 0,
        )
        # header and payload posted now, in piece order (the decode side matches them in
        # order): no loop turn between them, which a prefill's step thread could take for its
        # GIL slice (5 ms) while the decode side waits
        sends = [post_frame(ep, header)]
        try:
            sends.append(post(ep, [ucx_view(payload)], tag=PAYLOAD_TAG))
        except BaseException:
            sends[0].abandon()
            raise
        send = asyncio.ensure_future(self._sent(ep, sends, timeout))
        send.add_done_callback(
            retrieve_exception
        )  # a failure next to the stream's own is not logged
        # cancelled before its first step (a stream failing at once), the task never waits:
        # its posts are parked here, as UCX may still read them until the endpoint's abort ends
        send.add_done_callback(lambda _: [posted.abandon() for posted in sends])
        return send

    async def _sent(self, ep, sends: list, timeout: float) -> None:
        try:
            await wait_all(sends, timeout)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                ep.abort()  # both sides fail now, not after the headers already sent ahead
            raise  # (wait_all parked the buffers, the payload with them)
        self.metrics.bytes.labels("sent").inc(sends[1].buffers[0].nbytes)

    async def _finish(self, ep, end: StreamEnd, timeout: float, posted: deque) -> bool:
        header = kv_pb2.KvStreamPiece(
            final=True,
            status=end.status,
            message=end.message,
            first_token_id=end.first_token_id,
            finished=end.finished,
            lease_id=end.lease_id,
        )
        while posted and posted[0].done():
            await posted.popleft()  # a failed send: no final header
        await asyncio.wait_for(frames.send(ep, header), timeout)
        while posted:  # the final header went first: the decode side lands the last payload
            await posted.popleft()
        if end.status != kv_pb2.KV_PULL_STATUS_OK or end.finished:
            return False  # nothing to confirm: the decode side drops its blocks
        done = await asyncio.wait_for(frames.recv(ep, kv_pb2.KvPullDone), timeout)
        return done.ok and done.lease_id == end.lease_id
