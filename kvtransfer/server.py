"""Prefill side of the KV pull: a UCX listener that serves leased blocks.

    decode worker                                   prefill worker (this listener)
    ─────────────                                   ──────────────────────────────
    allocate destination blocks
    connect (endpoint pool) ───────────────────────▶ accept
    KvPullRequest(lease, geometry, hash) ──────────▶ check geometry + hash, look up lease
                                     ◀────────────── KvPullReply(status, bytes, checksum)
                                                     pack all layers' K and V of the lease's
                                                     blocks into one staging buffer (pack kernel)
    receive into staging  ◀════ payload in 1..k messages (never one per block)
    verify checksum, unpack into its blocks
    KvPullDone(ok) ────────────────────────────────▶ release the lease (blocks freed or cached)

A KvPullRequest with `stream` set is a streamed pull (the KV of a request still being prefilled,
layer group by layer group): layer_stream_server.py, handed over in `_serve`.

One pull owns an endpoint at a time, so messages of two pulls never interleave; an endpoint
serves pulls one after another until the peer closes it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Protocol

import torch

from splitserve.kernels import ops
from splitserve.kvtransfer.buffers import TransferStream, ucx_view
from splitserve.kvtransfer.checksum import payload_checksum_async, to_u64
from splitserve.kvtransfer.config import KvTransferConfig, TransferFaults
from splitserve.kvtransfer.descriptor import KvIncompatibleError, PoolSpec, check_compatible
from splitserve.kvtransfer.idle_wait import PullWake, until_message
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.protos import kv_pb2

log = logging.getLogger("splitserve.kvtransfer")
HANDLER_EXIT_S = 2.0


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


class KvTransferServer:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        spec: PoolSpec,
        leases: LeaseSource,
        config: KvTransferConfig,
        faults: TransferFaults | None = None,
        metrics: KvTransferMetrics | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.wake: PullWake | None = None
        self.spec = spec
        self.leases = leases
        self.config = config
        self.faults = faults or TransferFaults()
        self.metrics = metrics or KvTransferMetrics()
        self.stream = TransferStream(kv_cache.device)
        self._listener = None
        self.stream_sender = None  # a LayerStreamSender: serves KvPullRequest.stream (issue 32)
        self._handlers: dict[asyncio.Task, object] = {}  # handler task -> its accepted endpoint

    @property
    def port(self) -> int:
        return self._listener.port

    async def start(self) -> int:
        import ucxx

        self.wake = PullWake()  # expect_pull() wakes idle endpoints (idle_wait.py)

        self._listener = ucxx.create_listener(self._on_connect, self.config.listen_port)
        log.info("UCX listener on port %d", self.port)
        self.metrics.log_transports()
        return self.port

    async def _on_connect(self, ep) -> None:
        task = asyncio.current_task()
        self._handlers[task] = ep
        try:
            last = time.monotonic()
            while not ep.closed:
                # no polling receive while idle (idle_wait.py)
                await until_message(ep, last, self._expecting, self.wake)
                raw = await ep.recv_obj()
                last = time.monotonic()
                req = kv_pb2.KvPullRequest.FromString(bytes(raw))
                await self._serve(ep, req)
        except Exception as exc:  # the peer closed or died: nothing to clean but the endpoint
            log.debug("KV endpoint closed: %s", exc)
        finally:
            self._handlers.pop(task, None)
            if not ep.closed:
                ep.abort()

    def expect_pull(self) -> None:
        """A lease was granted (any thread): idle endpoints start probing for its pull."""
        if self.wake is not None:
            self.wake.notify()

    def _expecting(self) -> bool:
        pending = getattr(self.leases, "pulls_expected", None)
        return True if pending is None else pending()

    def _reply_error(self, status: int, message: str) -> kv_pb2.KvPullReply:
        return kv_pb2.KvPullReply(status=status, message=message)

    async def _serve(self, ep, req: kv_pb2.KvPullRequest) -> None:
        if req.stream:  # streamed pull: layer_stream_server.py
            if self.stream_sender is None:
                msg = "this prefill worker does not stream KV (kv_transfer.streaming off)"
                reply = self._reply_error(kv_pb2.KV_PULL_STATUS_ABORTED, msg)  # falls back
                await ep.send_obj(reply.SerializeToString())
            else:
                await self.stream_sender.serve_stream(ep, req, LeaseLookupError)
            return
        try:
            check_compatible(req, self.spec)
            blocks = self.leases.begin_pull(req.lease_id, req.request_id)
            if inspect.isawaitable(
                blocks
            ):  # a tensor-parallel follower may wait for rank 0's grant
                blocks = await blocks
        except KvIncompatibleError as exc:
            await ep.send_obj(
                self._reply_error(kv_pb2.KV_PULL_STATUS_INCOMPATIBLE, str(exc)).SerializeToString()
            )
            return
        except LeaseLookupError as exc:
            await ep.send_obj(self._reply_error(exc.status, str(exc)).SerializeToString())
            return
        # any failure below (timeout, dead peer) propagates to _on_connect, which aborts the
        # endpoint; end_pull has already unpinned the blocks
        delivered = False
        try:
            delivered = await self._send_blocks(ep, req, blocks)
        finally:
            self.leases.end_pull(req.lease_id, delivered)

    async def _send_blocks(self, ep, req: kv_pb2.KvPullRequest, blocks: list[int]) -> bool:
        self.stream.after_engine()
        with self.stream.context():
            ids = torch.tensor(blocks, dtype=torch.int64).to(
                self.kv_cache.device, non_blocking=True
            )
            packed = ops.pack_kv_blocks(self.kv_cache, ids)
            checksum = payload_checksum_async(packed) if self.config.verify_checksum else None
        await self.stream.wait()
        checksum = to_u64(checksum) if checksum is not None else 0
        payload = packed.reshape(-1).view(torch.uint8)
        limit = max(
            1,
            min(
                self.config.max_message_bytes,
                req.max_message_bytes or self.config.max_message_bytes,
            ),
        )
        hit = self.faults.hits(req.request_id)
        if hit and self.faults.message_bytes:
            limit = self.faults.message_bytes
        # Even pieces: the receiver sizes its buffers as ceil(bytes / num_messages).
        chunk = -(-payload.numel() // -(-payload.numel() // limit))
        pieces = [payload[i : i + chunk] for i in range(0, payload.numel(), chunk)]
        reply = kv_pb2.KvPullReply(
            status=kv_pb2.KV_PULL_STATUS_OK,
            payload_bytes=payload.numel(),
            num_messages=len(pieces),
            num_blocks=len(blocks),
            checksum=checksum,
        )
        if hit and self.faults.misstate_payload_bytes:
            reply.payload_bytes -= 1
        timeout = self.config.data_timeout_s  # a hung peer must not pin the blocks past this
        await asyncio.wait_for(ep.send_obj(reply.SerializeToString()), timeout)
        with self.metrics.sending.track_inprogress():
            return await self._send_payload(ep, req, pieces, payload.numel(), hit)

    async def _send_payload(
        self, ep, req: kv_pb2.KvPullRequest, pieces: list[torch.Tensor], nbytes: int, hit: bool
    ) -> bool:
        timeout = self.config.data_timeout_s
        if hit:
            pieces = self._apply_faults(pieces)
            await asyncio.sleep(self.faults.stall_before_payload_s)
            if self.faults.stall_after_first_message_s:  # the peer holds part of the payload
                await asyncio.wait_for(ep.send(ucx_view(pieces[0])), timeout)
                await asyncio.sleep(self.faults.stall_after_first_message_s)
                pieces = pieces[1:]
        # pipelined, tag-ordered
        await asyncio.wait_for(
            asyncio.gather(*(ep.send(ucx_view(piece)) for piece in pieces)), timeout
        )
        self.metrics.bytes.labels("sent").inc(nbytes)
        done = kv_pb2.KvPullDone.FromString(bytes(await asyncio.wait_for(ep.recv_obj(), timeout)))
        return done.ok

    def _apply_faults(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.faults.corrupt_payload:
            pieces = [p.clone() for p in pieces]
            pieces[0][: min(64, pieces[0].numel())] ^= 0x5A
        if self.faults.truncate_payload:
            pieces = [p.clone() for p in pieces]
            pieces[-1] = pieces[-1][
                : pieces[-1].numel() // 2
            ]  # fewer bytes on the wire than announced
        return pieces

    async def close_connections(self) -> None:
        """Drops every accepted endpoint (their peers see a dead connection); keeps listening."""
        for task, ep in list(self._handlers.items()):
            if not ep.closed:
                ep.abort()  # the peer's endpoint errors out: it must reconnect
            task.cancel()

    async def close(self) -> None:
        """Endpoints aborted, their handlers ended (awaited: a listener closed under a live
        handler is what hung processes at exit), then the listener; idempotent."""
        tasks = list(self._handlers)
        await self.close_connections()
        if (
            tasks
        ):  # bounded: a handler stuck in ucxx must not hold the stop (the exit deadline's job)
            _, stuck = await asyncio.wait(tasks, timeout=HANDLER_EXIT_S)
            if stuck:
                log.warning(
                    "%d KV endpoint handler(s) did not end within %.0fs of the close",
                    len(stuck),
                    HANDLER_EXIT_S,
                )
        if self._listener is not None:
            self._listener.close()
            self._listener = None
