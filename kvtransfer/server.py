"""Prefill side of the KV pull: a UCX listener that serves leased blocks.

    decode worker                                   prefill worker (this listener)
    ─────────────                                   ──────────────────────────────
    allocate destination blocks
    connect (endpoint pool, <= 16 per peer) ───────▶ accept
    KvPullRequest(lease, geometry, hash) ──────────▶ check geometry + hash, look up lease, pin
      (the reply's receive posted first)
                                     ◀────────────── KvPullReply header (status, bytes, messages):
                                                     sent at once, it needs no packed byte
                                                     zero-copy slabs straight from the pool when
                                                     the blocks are one run (large payloads),
                                                     else pack all layers' K and V (one kernel)
    receive into its blocks / staging ◀═══ payload in 1..k messages on the payload tag
                                     ◀────────────── KvPullReply trailer (checksum, computed while
                                                     the payload was on the wire)
    [checksum if between hosts] + unpack; pull() returns: the blocks are ready
    KvPullDone(ok) ─ ─ (after pull() returned) ─ ─ ▶ release the lease (blocks freed or cached)

Control messages are one frame each (frames.py: no size message first); the payload has its own
tag, so neither matches the other's receives. One round trip before the payload, none after it
on the critical path. Framing (buffers.py): payloads whose (layer, K/V) slabs are >= 1 MiB go
as whole slabs, so either side lands them in its pool directly when its blocks are one
contiguous run, independently of the other side. The checksum is verified per
`KvTransferConfig.checksum` (checksum.py: by default between hosts only).

A KvPullRequest with `stream` set is a streamed pull (the KV of a request still being prefilled,
layer group by layer group): layer_stream_server.py, handed over in `_serve`.

One pull owns an endpoint at a time, so messages of two pulls never interleave; an endpoint
serves pulls one after another until the peer closes it, or the listener does: what a peer may
hold is in connections.py (first request, refusals, idle time, max_connections), the idle wait
in idle_watch.py, the sends and receives (awaited without polling every loop turn) in
quiet_wait.py, the bind address in bound_listener.py. ucxx 0.52's Python API has no RMA
(memory registration, rkeys, put/get: only libucxx's C++ has them), so the payload moves as
tagged sends into posted receives, which UCX runs as rendezvous (zero-copy get) for large ones.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Protocol

import torch

from splitserve.kernels import ops
from splitserve.kvtransfer.bound_listener import create_listener
from splitserve.kvtransfer.buffers import (
    DeviceBytes,
    StagingCache,
    TransferStream,
    contiguous_start,
    ids_tensor,
    piece_views,
    plan_messages,
    slab_framed,
    slab_views,
)
from splitserve.kvtransfer.checksum import payload_checksum_async, readback, to_u64
from splitserve.kvtransfer.config import KvTransferConfig, TransferFaults
from splitserve.kvtransfer.connections import Connections
from splitserve.kvtransfer.descriptor import KvIncompatibleError, PoolSpec, check_compatible
from splitserve.kvtransfer.frames import PAYLOAD_TAG
from splitserve.kvtransfer.idle_wait import PullWake
from splitserve.kvtransfer.idle_watch import IdleWatch
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.kvtransfer.progress_wait import BOOST, set_up_progress
from splitserve.kvtransfer.quiet_wait import post_frame, recv_frame, send_all, send_frame
from splitserve.protos import kv_pb2

log = logging.getLogger("splitserve.kvtransfer")
HANDLER_EXIT_S = 2.0
# a pull's payload goes in at most this many messages, whatever message size the puller asks
# for: each is a posted send the listener tracks until it completes
MAX_MESSAGES = 1024


class LeaseLookupError(LookupError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class LeaseSource(Protocol):
    """The prefill worker's lease table, as the listener sees it (called on its event loop)."""

    def begin_pull(self, lease_id: str, request_id: str) -> list[int]:
        """Pins the lease's blocks for the pull (an expiry meanwhile cannot free them) and
        returns their ids in table order (or an awaitable of them); raises LeaseLookupError."""

    def end_pull(self, lease_id: str, delivered: bool) -> None:
        """Unpins; when delivered, the decode side has the data and the lease is released."""

    # optional: `pulls_expected() -> bool`, whether any lease is out (idle endpoints then probe
    # more often; without it, always assumed)


def _nbytes(piece) -> int:
    return piece.nbytes if hasattr(piece, "nbytes") else piece.numel() * piece.element_size()


def _error(status: int, message: str) -> kv_pb2.KvPullReply:
    return kv_pb2.KvPullReply(status=status, message=message)


class KvTransferServer:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        spec: PoolSpec,
        leases: LeaseSource,
        config: KvTransferConfig,
        faults: TransferFaults | None = None,
        metrics: KvTransferMetrics | None = None,
        host: str | None = None,
        drain_strays: bool = False,
    ) -> None:
        """`host`: the worker's own (the listener binds config.listen_host, else it; None:
        every interface); `drain_strays`: this process's UCX serves this listener only, so
        messages on no endpoint's tag are dropped (idle_watch.py)."""
        if not kv_cache.is_contiguous():  # payload buffers are addresses in it (buffers.py)
            raise ValueError("the KV pool must be one contiguous tensor")
        self.kv_cache = kv_cache
        self.host = config.listen_host or host
        self.drain_strays = drain_strays
        self.connections: Connections | None = None
        self.wake: PullWake | None = None
        self.spec = spec
        self.leases = leases
        self.config = config
        self.faults = faults or TransferFaults()
        self.metrics = metrics or KvTransferMetrics()
        self.stream = TransferStream(kv_cache.device)
        self.staging = StagingCache(kv_cache.device, kv_cache.dtype)
        self._listener = None
        self.stream_sender = None  # a LayerStreamSender: serves KvPullRequest.stream (issue 32)

    @property
    def port(self) -> int:
        return self._listener.port

    @property
    def _handlers(self) -> dict:  # handler task -> its connection
        return self.connections.handlers if self.connections is not None else {}

    async def start(self) -> int:
        self.wake = PullWake()  # expect_pull() wakes idle endpoints (idle_wait.py)
        watch = IdleWatch(self.wake, self._expecting, self.drain_strays)
        self.connections = Connections(self.config, watch)
        self._listener = create_listener(self._on_connect, self.config.listen_port, self.host)
        log.info("UCX listener on %s:%d", self._listener.ip, self.port)
        self.metrics.log_transports()
        # before any pull: an idle listener must not wake ucxx's thread every millisecond
        set_up_progress(self.config, self.kv_cache.device.type)
        return self.port

    async def _on_connect(self, ep) -> None:
        await self.connections.run(ep, self._serve)

    def expect_pull(self) -> None:
        """A lease was granted (any thread): idle endpoints start probing for its pull."""
        if self.wake is not None:
            self.wake.notify()

    def _expecting(self) -> bool:
        pending = getattr(self.leases, "pulls_expected", None)
        return True if pending is None else pending()

    async def _serve(self, ep, req: kv_pb2.KvPullRequest, buf) -> bool:
        """One pull; False when it was refused (the peer then drops the endpoint)."""
        with BOOST.busy():  # its payload's completions found at once (progress_wait.py)
            if req.stream:  # streamed pull: layer_stream_server.py
                if self.stream_sender is None:
                    msg = "this prefill worker does not stream KV (kv_transfer.streaming off)"
                    await self._refuse(ep, kv_pb2.KV_PULL_STATUS_ABORTED, msg)  # falls back
                    return False
                await self.stream_sender.serve_stream(ep, req, LeaseLookupError)
                return True
            try:
                check_compatible(req, self.spec)
                blocks = self.leases.begin_pull(req.lease_id, req.request_id)
                if inspect.isawaitable(blocks):  # a TP follower may wait for rank 0's grant
                    blocks = await blocks
            except KvIncompatibleError as exc:
                await self._refuse(ep, kv_pb2.KV_PULL_STATUS_INCOMPATIBLE, str(exc))
                return False
            except LeaseLookupError as exc:
                await self._refuse(ep, exc.status, str(exc))
                return False
            # any failure below (timeout, dead peer) propagates to the connection, which aborts
            # the endpoint; end_pull has already unpinned the blocks
            delivered = False
            try:
                delivered = await self._send_blocks(ep, req, blocks, buf)
            finally:
                self.leases.end_pull(req.lease_id, delivered)
            return True

    async def _refuse(self, ep, status: int, message: str) -> None:
        await send_frame(ep, _error(status, message), self.config.lease_request_timeout_s)

    async def _send_blocks(self, ep, req: kv_pb2.KvPullRequest, blocks: list[int], buf) -> bool:
        n = len(blocks)
        layers = self.kv_cache.shape[0]
        nbytes = n * self.kv_cache[0, 0, 0].numel() * 2 * layers * self.kv_cache.element_size()
        limit = self.config.message_limit(req.max_message_bytes)
        hit = self.faults.hits(req.request_id)
        if hit and self.faults.message_bytes:
            limit = self.faults.message_bytes
        num_messages = min(plan_messages(nbytes, layers, limit), MAX_MESSAGES)
        run = contiguous_start(blocks)
        zero_copy = run is not None and slab_framed(num_messages, nbytes, layers)
        # the header goes at once: it depends on the geometry only, not on the packed bytes
        reply = kv_pb2.KvPullReply(
            status=kv_pb2.KV_PULL_STATUS_OK,
            payload_bytes=nbytes,
            num_messages=num_messages,
            num_blocks=n,
        )
        if hit and self.faults.misstate_payload_bytes:
            reply.payload_bytes -= 1
        timeout = self.config.data_timeout_s  # a hung peer must not pin the blocks past this
        header = post_frame(ep, reply)  # posted now, before any stream work
        payload, checksum = None, None
        try:
            payload, pieces = self._payload(blocks, run, n, num_messages, zero_copy)
            await self.stream.wait()
            # the trailer's checksum: on the GPU computed while the payload is on the wire; on
            # the CPU once it left (the host's cores move the payload first)
            if req.skip_checksum:  # the puller does not verify it: no reduction, no read-back
                checksum = asyncio.get_running_loop().create_future()
                checksum.set_result(0)
            elif payload.is_cuda:
                checksum = asyncio.ensure_future(self._checksum(payload))
            with self.metrics.sending.track_inprogress():
                await header.wait(timeout)
                sent = await self._send_payload(ep, pieces, hit)
            self.metrics.bytes.labels("sent").inc(nbytes)
            checksum = checksum or asyncio.ensure_future(self._checksum(payload))
            trailer = kv_pb2.KvPullReply(  # the bytes really sent: a receiver that verifies
                status=kv_pb2.KV_PULL_STATUS_OK, checksum=await checksum, payload_bytes=sent
            )  # checks them too (a short message leaves stale bytes the checksum could match)
            await send_frame(ep, trailer, timeout)
            done = await recv_frame(ep, kv_pb2.KvPullDone, buf, timeout)
        finally:
            header.abandon()  # (a no-op once it was sent)
            if checksum is not None:
                checksum.cancel()
            if payload is not None and not zero_copy:
                self.staging.give(payload)
        return done.ok

    def _payload(self, blocks: list[int], run, n: int, num_messages: int, zero_copy: bool):
        """(payload, its UCX pieces): the pool's own slabs, or the blocks packed into staging,
        ordered on the transfer stream after the prefill's writes of these blocks."""
        self.stream.after_engine()
        with self.stream.context():
            if zero_copy:
                return (
                    self.kv_cache[:, :, run : run + n],
                    slab_views(self.kv_cache, run, n, num_messages),
                )
            shape = (*self.kv_cache.shape[:2], n, *self.kv_cache.shape[3:])
            ids = ids_tensor(blocks, self.kv_cache.device)
            payload = ops.pack_kv_blocks(self.kv_cache, ids, out=self.staging.take(shape))
            return payload, piece_views(payload, num_messages)

    async def _checksum(self, payload: torch.Tensor) -> int:
        if not payload.is_cuda:  # the CPU sums off the loop: UCX's completions keep flowing
            return to_u64(await asyncio.to_thread(payload_checksum_async, payload))
        with self.stream.context():
            host = readback(payload_checksum_async(payload))
        await self.stream.wait()
        return to_u64(host)

    async def _send_payload(self, ep, pieces: list, hit: bool) -> int:
        """Sends the pieces; returns the bytes sent."""
        timeout = self.config.data_timeout_s
        sent = 0
        if hit:
            pieces = self._apply_faults(pieces)
            if self.faults.stall_before_payload_s:  # (no loop turn lost when there is none)
                await asyncio.sleep(self.faults.stall_before_payload_s)
            if self.faults.stall_after_first_message_s:  # the peer holds part of the payload
                await send_all(ep, pieces[:1], timeout, PAYLOAD_TAG)
                await asyncio.sleep(self.faults.stall_after_first_message_s)
                sent, pieces = _nbytes(pieces[0]), pieces[1:]
        await send_all(ep, pieces, timeout, PAYLOAD_TAG)  # pipelined, tag-ordered
        return sent + sum(_nbytes(p) for p in pieces)

    def _apply_faults(self, pieces: list) -> list:
        pieces = [p.tensor() if isinstance(p, DeviceBytes) else p for p in pieces]
        if self.faults.corrupt_payload:  # copies: never the pool's own blocks
            pieces = [p.clone() if isinstance(p, torch.Tensor) else p.copy() for p in pieces]
            pieces[0][:64] ^= 0x5A
        if self.faults.truncate_payload:  # fewer bytes on the wire than announced
            pieces = [*pieces[:-1], pieces[-1][: len(pieces[-1]) // 2]]
        return pieces

    async def close_connections(self) -> None:
        """Drops every accepted endpoint (their peers see a dead connection); keeps listening."""
        if self.connections is not None:
            self.connections.close_all()

    async def close(self) -> None:
        """Endpoints aborted, their handlers ended (awaited: a listener closed under a live
        handler is what hung processes at exit), then the listener; idempotent."""
        tasks = self.connections.close_all() if self.connections is not None else []
        if tasks:  # bounded: a handler stuck in ucxx must not hold the stop (the exit deadline's)
            _, stuck = await asyncio.wait(tasks, timeout=HANDLER_EXIT_S)
            if stuck:
                log.warning(
                    "%d KV endpoint handler(s) did not end within %.0fs of the close",
                    len(stuck),
                    HANDLER_EXIT_S,
                )
        if self.connections is not None:
            self.connections.watch.stop()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        BOOST.rest_now()  # the loop may end before the polling linger does
