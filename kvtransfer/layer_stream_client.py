"""Decode side of a streamed pull (message sequence in layer_stream_server.py): ask the prefill
worker's listener for a request's KV while it is prefilled, land each layer group's piece in the
reserved blocks as it arrives, and return the first token from the stream's last message.

Every wait has a timeout; a failure raises `KvTransferError` (errors.py) and the endpoint is
aborted, never reused. Tensor-parallel pools are not streamed (the router uses the classic pull).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import torch

from splitserve.kvtransfer import frames
from splitserve.kvtransfer.buffers import TransferStream, receive_or_abort, ucx_view
from splitserve.kvtransfer.checksum import payload_checksum_async, to_u64, wants_checksum
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.endpoint_pool import EndpointPool
from splitserve.kvtransfer.errors import KvTransferError
from splitserve.kvtransfer.frames import PAYLOAD_TAG
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.protos import kv_pb2

_STATUS_REASON = {
    kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN: "lease_unknown",
    kv_pb2.KV_PULL_STATUS_LEASE_EXPIRED: "lease_expired",
    kv_pb2.KV_PULL_STATUS_INCOMPATIBLE: "incompatible",
    kv_pb2.KV_PULL_STATUS_ABORTED: "aborted",
}


@dataclass(frozen=True)
class StreamResult:
    first_token_id: int
    finished: bool  # the first token ended the request on the prefill side
    num_bytes: int
    seconds: float
    last_piece_at: float  # perf_counter when the last piece had landed (the final message came)


class LayerStreamClient:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        spec: PoolSpec,
        config: KvTransferConfig,
        pool: EndpointPool,
        metrics: KvTransferMetrics,
    ) -> None:
        self.kv_cache = kv_cache
        self.spec = spec
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.stream = TransferStream(kv_cache.device)
        self._live: dict[str, object] = {}  # request id -> the endpoint its stream uses
        self._cancelled: set[str] = set()  # aborted before their endpoint was connected

    def abort(self, request_id: str) -> None:
        """Ends a stream whose Decode was cancelled: its endpoint is aborted, so the pull fails at
        once (its posted receive ends) instead of waiting for the prefill to finish."""
        ep = self._live.get(request_id)
        if ep is None:
            self._cancelled.add(request_id)  # still connecting: it stops once connected
        elif not ep.closed:
            ep.abort()

    async def pull(
        self,
        host: str,
        port: int,
        request_id: str,
        num_tokens: int,
        dest_blocks: list[int],
        token: str = "",
    ) -> StreamResult:
        """`token`: the request's stream secret (KvStreamSource.token)."""
        try:
            return await self._pull(host, port, request_id, num_tokens, dest_blocks, token)
        except KvTransferError as exc:
            self.metrics.failures.labels(exc.reason).inc()
            raise

    async def _pull(
        self, host: str, port: int, request_id: str, num_tokens: int, dest: list[int], token: str
    ) -> StreamResult:
        start = time.perf_counter()
        try:
            ep, _ = await self.pool.acquire(host, port)
        except BaseException:
            self._cancelled.discard(request_id)
            raise
        if request_id in self._cancelled:
            self._cancelled.discard(request_id)
            self.pool.release(host, port, ep)  # unused: still good for the next pull
            raise KvTransferError("cancelled", "the Decode call was cancelled")
        self._live[request_id] = ep
        try:
            verify = wants_checksum(self.config.checksum, host)
            request = kv_pb2.KvPullRequest(
                request_id=request_id,
                stream=True,
                num_tokens=num_tokens,
                stream_token=token,
                max_message_bytes=self.config.max_message_bytes,
                **self.spec.fields(),
            )
            result = await self._exchange(ep, request, dest, start, verify)
        except BaseException:
            self.pool.discard(host, port, ep)  # half-used: it may hold stray messages
            raise
        finally:
            self._live.pop(request_id, None)
        self.pool.release(host, port, ep)
        self.metrics.seconds.observe(result.seconds)
        self.metrics.bytes.labels("received").inc(result.num_bytes)
        return result

    async def _recv_obj(self, ep, timeout: float, what: str, cls):
        try:
            return await asyncio.wait_for(frames.recv(ep, cls), timeout)
        except TimeoutError as exc:
            raise KvTransferError("data_timeout", f"no {what} within {timeout}s") from exc
        except Exception as exc:
            raise KvTransferError(
                "peer_failed", f"prefill worker failed during the stream ({what}): {exc}"
            ) from exc

    async def _exchange(
        self, ep, request: kv_pb2.KvPullRequest, dest: list[int], start: float, verify: bool
    ) -> StreamResult:
        cfg = self.config
        try:
            await asyncio.wait_for(frames.send(ep, request), cfg.lease_request_timeout_s)
        except Exception as exc:
            raise KvTransferError("peer_failed", f"stream request not sent: {exc}") from exc
        # the request may not have reached the prefill worker yet: it waits up to its own
        # lease request timeout, so give the reply that long again
        reply = await self._recv_obj(
            ep, 2 * cfg.lease_request_timeout_s, "stream reply", kv_pb2.KvPullReply
        )
        if reply.status != kv_pb2.KV_PULL_STATUS_OK:
            raise self._refused(reply.status, reply.message)
        nbytes = 0
        device = self.kv_cache.device
        dest_ids = torch.tensor(dest, dtype=torch.int64).to(device, non_blocking=True)
        while True:
            head = await self._recv_obj(
                ep, cfg.data_timeout_s, "stream piece", kv_pb2.KvStreamPiece
            )
            if head.final:
                if head.status != kv_pb2.KV_PULL_STATUS_OK:
                    raise self._refused(head.status, head.message)
                await self.stream.wait()  # every piece landed before the first step may run
                landed = time.perf_counter()
                if not head.finished:
                    ok = kv_pb2.KvPullDone(lease_id=head.lease_id, ok=True)
                    await frames.send(ep, ok)
                return StreamResult(
                    head.first_token_id, head.finished, nbytes, landed - start, landed
                )
            nbytes += await self._land(ep, head, dest_ids, verify)

    async def _land(
        self, ep, head: kv_pb2.KvStreamPiece, dest_ids: torch.Tensor, verify: bool
    ) -> int:
        """One piece into its blocks; its checksum checked when `verify` (checksum.py)."""
        s = self.spec
        layers = head.layer_end - head.layer_start
        blocks = head.block_end - head.block_start
        shape = (layers, 2, blocks, s.block_size, s.num_kv_heads, s.head_dim)
        if not (
            layers > 0
            and head.layer_end <= s.num_layers
            and blocks > 0
            and head.block_end <= dest_ids.numel()
        ):
            raise KvTransferError("invalid", f"stream piece out of range: {head}")
        # UCX writes outside any CUDA stream: staging from the transfer stream, drained first
        with self.stream.context():
            staging = torch.empty(shape, dtype=self.kv_cache.dtype, device=self.kv_cache.device)
        await self.stream.wait()
        payload = staging.reshape(-1).view(torch.uint8)
        if head.payload_bytes != payload.numel():
            raise KvTransferError(
                "invalid", f"piece of {head.payload_bytes} bytes; expected {payload.numel()}"
            )
        try:
            await receive_or_abort(
                ep,
                ep.recv(ucx_view(payload), tag=PAYLOAD_TAG),
                self.config.data_timeout_s,
                keep=(staging,),
            )
        except TimeoutError as exc:
            raise KvTransferError("data_timeout", "stream piece payload timed out") from exc
        except Exception as exc:
            raise KvTransferError("peer_failed", f"prefill worker failed mid-piece: {exc}") from exc
        self.stream.after_engine()  # a block freed a moment ago may still be written by a step
        with self.stream.context():
            if verify:
                checksum = payload_checksum_async(staging)
            ids = dest_ids[head.block_start : head.block_end]
            self.kv_cache[head.layer_start : head.layer_end].index_copy_(2, ids, staging)
        if verify:
            await self.stream.wait()
            if to_u64(checksum) != head.checksum:
                raise KvTransferError("checksum", "a KV stream piece failed its checksum")
        return payload.numel()

    @staticmethod
    def _refused(status: int, message: str) -> KvTransferError:
        reason = _STATUS_REASON.get(status, "rejected")
        code = (
            grpc.StatusCode.FAILED_PRECONDITION
            if reason == "incompatible"
            else grpc.StatusCode.UNAVAILABLE
        )
        return KvTransferError(reason, message or f"stream refused ({reason})", code)
