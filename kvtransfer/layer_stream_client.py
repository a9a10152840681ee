"""Decode side of a streamed pull (message sequence in layer_stream_server.py): ask the prefill
worker's listener for a request's KV while it is prefilled, land each layer group's piece in the
reserved blocks as it arrives, and return the first token from the stream's last message.

Every wait has a timeout; a failure raises `KvTransferError` (errors.py) and the endpoint is
aborted, never reused. A tensor-parallel prefill is streamed shard by shard, all at once
(layer_stream_shards.py): each stream carries one rank's KV heads, which land in their slice of
the pool, or (a tensor-parallel decode worker) in staging that `install` spreads over the ranks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import torch

from splitserve.kvtransfer import frames
from splitserve.kvtransfer.buffers import TransferStream, receive_or_abort, ucx_view
from splitserve.kvtransfer.checksum import payload_checksum_async, to_u64, wants_checksum
from splitserve.kvtransfer.client import Installer
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.endpoint_pool import EndpointPool
from splitserve.kvtransfer.errors import KvTransferError
from splitserve.kvtransfer.frames import PAYLOAD_TAG
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.kvtransfer.progress_wait import BOOST
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
        head_range: tuple[int, int] | None = None,
        install: Installer | None = None,
    ) -> None:
        """`head_range`, `install`: as for KvTransferClient (client.py)."""
        self.kv_cache = kv_cache
        self.spec = spec
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.head_range = head_range or (0, spec.num_kv_heads)
        self.install = install
        self.stream = TransferStream(kv_cache.device)
        self._live: dict[str, list] = {}  # request id -> the endpoints its shards' streams use
        self._cancelled: set[str] = set()  # aborted: shards still connecting stop once connected

    def abort(self, request_id: str) -> None:
        """Ends a request's streams (a cancelled Decode, a failed shard): their endpoints are
        aborted, so each pull fails at once (its posted receive ends) instead of waiting for the
        prefill to finish. The caller `forget`s the request once every shard's pull ended."""
        self._cancelled.add(request_id)
        for ep in self._live.get(request_id, ()):
            if not ep.closed:
                ep.abort()

    def forget(self, request_id: str) -> None:
        self._cancelled.discard(request_id)

    async def pull(
        self,
        host: str,
        port: int,
        request_id: str,
        num_tokens: int,
        dest_blocks: list[int],
        token: str = "",
        heads: tuple[int, int] | None = None,
        confirm: Callable[[], Awaitable[None]] | None = None,
    ) -> StreamResult:
        """`token`: the request's stream secret (KvStreamSource.token); `heads`: the model's KV
        heads this listener holds (default all); `confirm`: awaited after the final message and
        before KvPullDone (rank 0's stream: every other shard has landed; raising fails it)."""
        try:
            with BOOST.busy():  # completions found at once (progress_wait.py)
                return await self._pull(
                    host, port, request_id, num_tokens, dest_blocks, token, heads, confirm
                )
        except KvTransferError as exc:
            self.metrics.failures.labels(exc.reason).inc()
            raise

    async def _pull(
        self,
        host: str,
        port: int,
        request_id: str,
        num_tokens: int,
        dest: list[int],
        token: str,
        heads: tuple[int, int] | None,
        confirm,
    ) -> StreamResult:
        start = time.perf_counter()
        heads = heads or (0, self.spec.num_kv_heads)
        if self.install is None and not (
            self.head_range[0] <= heads[0] < heads[1] <= self.head_range[1]
        ):
            raise KvTransferError(
                "invalid",
                f"shard heads {list(heads)} are not in this pool's {list(self.head_range)}",
            )
        ep, _ = await self.pool.acquire(host, port)
        if request_id in self._cancelled:
            self.pool.release(host, port, ep)  # unused: still good for the next pull
            raise KvTransferError("cancelled", "the Decode call was cancelled")
        live = self._live.setdefault(request_id, [])
        live.append(ep)
        try:
            verify = wants_checksum(self.config.checksum, host)
            request = kv_pb2.KvPullRequest(
                request_id=request_id,
                stream=True,
                num_tokens=num_tokens,
                stream_token=token,
                max_message_bytes=self.config.max_message_bytes,
                skip_checksum=not verify,
                **self.spec.fields(),
            )
            landing = _Landing(self, dest, heads)
            result = await self._exchange(ep, request, landing, start, verify, confirm)
        except BaseException:
            self.pool.discard(host, port, ep)  # half-used: it may hold stray messages
            raise
        finally:
            live.remove(ep)
            if not live:
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
        self, ep, request: kv_pb2.KvPullRequest, landing, start: float, verify: bool, confirm
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
        while True:
            head = await self._recv_obj(
                ep, cfg.data_timeout_s, "stream piece", kv_pb2.KvStreamPiece
            )
            if head.final:
                if head.status != kv_pb2.KV_PULL_STATUS_OK:
                    raise self._refused(head.status, head.message)
                await self.stream.wait()  # every piece landed before the first step may run
                if not head.finished:
                    await landing.installed()
                    if confirm is not None:  # rank 0: every other shard landed too
                        await confirm()
                landed = time.perf_counter()
                if not head.finished:
                    ok = kv_pb2.KvPullDone(lease_id=head.lease_id, ok=True)
                    await frames.send(ep, ok)
                return StreamResult(
                    head.first_token_id, head.finished, nbytes, landed - start, landed
                )
            nbytes += await self._land(ep, head, landing, verify)

    async def _land(self, ep, head: kv_pb2.KvStreamPiece, landing, verify: bool) -> int:
        """One piece into its blocks; its checksum checked when `verify` (checksum.py)."""
        s = self.spec
        layers = head.layer_end - head.layer_start
        blocks = head.block_end - head.block_start
        shape = (layers, 2, blocks, s.block_size, landing.num_heads, s.head_dim)
        if not (
            layers > 0
            and head.layer_end <= s.num_layers
            and blocks > 0
            and head.block_end <= len(landing.dest)
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
            landing.put(head, staging)
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


class _Landing:
    """Where one shard's pieces go: straight into its heads of the pool's blocks, or (with
    `install`: a tensor-parallel decode worker) into staging installed once the shard is whole."""

    def __init__(self, client: LayerStreamClient, dest: list[int], heads: tuple[int, int]) -> None:
        self.client, self.dest, self.heads = client, dest, heads
        self.num_heads = heads[1] - heads[0]
        cache = client.kv_cache
        self.ids = torch.tensor(dest, dtype=torch.int64).to(cache.device, non_blocking=True)
        self.staging: torch.Tensor | None = None

    def put(self, head: kv_pb2.KvStreamPiece, piece: torch.Tensor) -> None:
        """On the transfer stream."""
        c, l0, l1 = self.client, head.layer_start, head.layer_end
        b0, b1 = head.block_start, head.block_end
        if c.install is not None:
            if self.staging is None:
                s = c.spec
                shape = (s.num_layers, 2, len(self.dest), s.block_size, self.num_heads, s.head_dim)
                self.staging = torch.zeros(shape, dtype=c.kv_cache.dtype, device=c.kv_cache.device)
            self.staging[l0:l1, :, b0:b1] = piece
            return
        h0 = c.head_range[0]
        dst = c.kv_cache[l0:l1]
        if self.heads != c.head_range:  # one prefill rank's heads: their slice of the pool
            dst = dst[:, :, :, :, self.heads[0] - h0 : self.heads[1] - h0]
        dst.index_copy_(2, self.ids[b0:b1], piece)

    async def installed(self) -> None:
        """The shard's staging spread over the ranks (install), before the first step."""
        c = self.client
        if c.install is not None and self.staging is not None:
            await c.install(self.staging, list(self.dest), *self.heads)
