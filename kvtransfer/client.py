"""Decode side of the KV pull (protocol diagram in server.py): connect, ask for the lease,
receive the payload into the destination blocks (one contiguous run, slab framing) or into
staging, verify (between hosts by default), unpack; the trailer and KvPullDone finish after
`pull` returned, and only then does the endpoint go back to the pool.

A handle with a tensor-parallel shard map is pulled shard by shard (shards.py: other ranks
concurrently, rank 0 last); each shard's heads land in their slice of the pool, or go to
`install` (a tensor-parallel decode worker's rank 0 spreads them over its ranks).

Every wait has a timeout; a failure raises `KvTransferError` (errors.py) with a reason label, and
the endpoint involved is aborted instead of being returned to the pool (endpoint_pool.py;
re-created next time).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

import grpc
import torch

from splitserve.kernels import ops
from splitserve.kvtransfer import frames
from splitserve.kvtransfer.buffers import (
    StagingCache,
    TransferStream,
    contiguous_start,
    ids_tensor,
    piece_views,
    receive_or_abort,
    slab_framed,
    slab_views,
)
from splitserve.kvtransfer.checksum import (
    payload_checksum_async,
    readback,
    to_u64,
    wants_checksum,
)
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.descriptor import KvIncompatibleError, PoolSpec, check_compatible
from splitserve.kvtransfer.endpoint_pool import EndpointPool
from splitserve.kvtransfer.errors import KvTransferError
from splitserve.kvtransfer.frames import PAYLOAD_TAG
from splitserve.kvtransfer.lease_request import request_lease
from splitserve.kvtransfer.metrics import KvTransferMetrics
from splitserve.kvtransfer.progress_wait import BOOST
from splitserve.kvtransfer.pull_stats import PullStats, lap
from splitserve.kvtransfer.quiet_wait import recv_all, retrieve_exception
from splitserve.kvtransfer.shards import ShardSource, shard_sources
from splitserve.protos import kv_pb2

# install(staging [L,2,n,BS,heads,D], dest_blocks, head_start, head_end): places a verified
# shard somewhere other than this client's own pool
log = logging.getLogger("splitserve.kvtransfer")
Installer = Callable[[torch.Tensor, list[int], int, int], Awaitable[None]]


class KvTransferClient:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        spec: PoolSpec,
        config: KvTransferConfig,
        metrics: KvTransferMetrics | None = None,
        head_range: tuple[int, int] | None = None,
        install: Installer | None = None,
    ) -> None:
        """`head_range`: the model's KV heads that `kv_cache` holds (default all: spec.num_kv_heads);
        `install`: where verified shards go instead of `kv_cache` (None: unpacked into it)."""
        if not kv_cache.is_contiguous():  # payload buffers are addresses in it (buffers.py)
            raise ValueError("the KV pool must be one contiguous tensor")
        self.kv_cache = kv_cache
        self.metrics = metrics or KvTransferMetrics()
        self.spec = spec
        self.config = config
        self.head_range = head_range or (0, spec.num_kv_heads)
        self.install = install
        self.stream = TransferStream(kv_cache.device)
        self.pool = EndpointPool(config.connect_timeout_s)
        self.staging = StagingCache(kv_cache.device, kv_cache.dtype)
        self._tails: set[asyncio.Task] = set()  # pulls' last messages, off the critical path

    async def pull(self, handle: kv_pb2.KvHandle, dest_blocks: list[int]) -> PullStats:
        try:
            with BOOST.busy():  # completions found at once (progress_wait.py)
                return await self._pull(handle, dest_blocks)
        except KvTransferError as exc:
            self.metrics.failures.labels(exc.reason).inc()
            raise

    async def _pull(self, handle: kv_pb2.KvHandle, dest_blocks: list[int]) -> PullStats:
        try:
            check_compatible(handle, self.spec)
        except KvIncompatibleError as exc:
            raise KvTransferError(
                "incompatible", str(exc), grpc.StatusCode.FAILED_PRECONDITION
            ) from exc
        if len(dest_blocks) != handle.num_blocks:
            raise KvTransferError(
                "invalid",
                f"{len(dest_blocks)} destination blocks for a handle of {handle.num_blocks}",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        try:
            sources = shard_sources(handle)
        except ValueError as exc:
            raise KvTransferError("invalid", str(exc), grpc.StatusCode.INVALID_ARGUMENT) from exc
        start = time.perf_counter()
        # every shard but rank 0's at once; each writes its own heads, so all must end before the
        # blocks can go back on a failure (no exception leaves while a sibling still writes)
        results = await asyncio.gather(
            *(self._pull_source(handle, src, dest_blocks) for src in sources[:-1]),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        last, phases = await self._pull_source(handle, sources[-1], dest_blocks)
        nbytes = last + sum(r[0] for r in results)
        stats = PullStats(nbytes, time.perf_counter() - start, phases)
        self.metrics.seconds.observe(stats.seconds)
        for name, seconds in phases.items():
            self.metrics.pull_phase.labels(name).observe(seconds)
        self.metrics.bytes.labels("received").inc(nbytes)
        self.metrics.gbps.set(stats.gbps)
        return stats

    async def _pull_source(
        self, handle: kv_pb2.KvHandle, src: ShardSource, dest_blocks: list[int]
    ) -> tuple[int, dict[str, float]]:
        host, port = src.host, src.port
        t0 = time.perf_counter()
        ep, reused = await self.pool.acquire(host, port)
        phases = {"connect": time.perf_counter() - t0}
        try:
            nbytes, tail = await self._exchange(ep, handle, src, dest_blocks, phases)
        except KvTransferError as exc:
            retry = reused and exc.reason == "peer_failed" and not exc.payload_started
            # a half-used endpoint may hold stray messages: never reuse it
            self.pool.discard(host, port, ep, keep_slot=retry)
            if not retry:
                raise
            # a cached endpoint whose peer restarted: one retry on a fresh connection
            t0 = time.perf_counter()
            ep, _ = await self.pool.acquire(host, port, fresh=True)
            phases["connect"] += time.perf_counter() - t0
            try:
                nbytes, tail = await self._exchange(ep, handle, src, dest_blocks, phases)
            except BaseException:
                self.pool.discard(host, port, ep)
                raise
        except BaseException:
            self.pool.discard(host, port, ep)
            raise
        # the rest of the pull (trailer, KvPullDone) is off the critical path: the endpoint
        # goes back to the pool when it is done
        task = asyncio.ensure_future(self._finish(host, port, ep, *tail))
        self._tails.add(task)
        task.add_done_callback(self._tails.discard)
        return nbytes, phases

    async def _finish(
        self, host: str, port: int, ep, trailer: asyncio.Future, done: kv_pb2.KvPullDone
    ) -> None:
        try:
            await asyncio.wait_for(trailer, self.config.lease_request_timeout_s)
            await asyncio.wait_for(frames.send(ep, done), self.config.lease_request_timeout_s)
        except BaseException as exc:
            self.pool.discard(host, port, ep)
            log.debug("KV pull's KvPullDone not sent: %s", exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.pool.release(host, port, ep)

    def _unpack_local(self, staging: torch.Tensor, ids: torch.Tensor, src: ShardSource) -> None:
        h0, h1 = self.head_range
        if (src.head_start, src.head_end) == (h0, h1):
            ops.unpack_kv_blocks(staging, self.kv_cache, ids)
        else:  # one shard of a tensor-parallel prefill: its heads' slice of this pool
            self.kv_cache[:, :, :, :, src.head_start - h0 : src.head_end - h0].index_copy_(
                2, ids, staging
            )

    async def _exchange(
        self,
        ep,
        handle: kv_pb2.KvHandle,
        src: ShardSource,
        dest_blocks: list[int],
        phases: dict[str, float],
    ) -> tuple[int, tuple[asyncio.Future, kv_pb2.KvPullDone]]:
        """One shard's pull on `ep`; adds the seconds of each phase after the connect to
        `phases` (a retry on a fresh endpoint adds to the first try's)."""
        cfg = self.config
        buf = frames.new_buffer()
        t = time.perf_counter()
        verify = wants_checksum(cfg.checksum, src.host)
        reply = await request_lease(ep, handle, self.spec, cfg, buf, verify)
        t = lap(phases, "request", t)
        if self.install is None and not (
            self.head_range[0] <= src.head_start and src.head_end <= self.head_range[1]
        ):
            raise KvTransferError(
                "invalid",
                f"shard heads [{src.head_start}, {src.head_end}) are not in this "
                f"pool's heads {list(self.head_range)}",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        n, layers = len(dest_blocks), self.spec.num_layers
        shape = (layers, 2, n, self.spec.block_size, src.num_heads, self.spec.head_dim)
        nbytes = math.prod(shape) * self.kv_cache.element_size()
        if reply.payload_bytes != nbytes or reply.num_messages < 1:
            raise KvTransferError(
                "invalid",
                f"payload of {reply.payload_bytes} bytes in {reply.num_messages} "
                f"messages; expected {nbytes} bytes",
            )
        run = contiguous_start(dest_blocks)
        # straight into the pool: one contiguous run of blocks holding all of its heads
        direct = (
            self.install is None
            and run is not None
            and (src.head_start, src.head_end) == self.head_range
            and slab_framed(reply.num_messages, nbytes, layers)
        )
        # UCX writes outside any CUDA stream: into the pool only once the engine's queued
        # kernels (a step may still write a block freed just before) are done; into staging
        # from the transfer stream's pool once that stream (an earlier pull's unpack) drained
        if direct:
            self.stream.after_engine()
            payload, staging = self.kv_cache[:, :, run : run + n], None
            buffers = slab_views(self.kv_cache, run, n, reply.num_messages)
        else:
            with self.stream.context():
                payload = staging = self.staging.take(shape)
            buffers = piece_views(staging, reply.num_messages)
        await self.stream.wait()
        t = lap(phases, "ready", t)
        trailer = asyncio.ensure_future(frames.recv(ep, kv_pb2.KvPullReply, buf))
        trailer.add_done_callback(
            retrieve_exception
        )  # a failed or cancelled trailer is not an error
        try:
            await receive_or_abort(
                ep, self._receive(ep, buffers), cfg.data_timeout_s, trailer, keep=(staging, buf)
            )
        except TimeoutError as exc:
            raise KvTransferError(
                "data_timeout", f"KV payload not received within {cfg.data_timeout_s}s"
            ) from exc
        except Exception as exc:
            raise KvTransferError(
                "peer_failed", f"prefill worker failed mid-transfer: {exc}", payload_started=True
            ) from exc
        t = lap(phases, "payload", t)
        try:
            await self._land(payload, staging, dest_blocks, src, trailer if verify else None)
            lap(phases, "land", t)
        except BaseException:
            trailer.cancel()
            raise
        finally:
            if staging is not None and self.install is None:
                self.staging.give(staging)
        return nbytes, (trailer, kv_pb2.KvPullDone(lease_id=handle.lease_id, ok=True))

    async def _land(self, payload, staging, dest_blocks, src: ShardSource, trailer) -> None:
        """Checksum (when `trailer` is given) and unpack in one pass of the transfer stream,
        then one wait. On a mismatch the destination blocks hold garbage, but they were never
        admitted: they go back unused."""
        if staging is not None:  # the unpack writes blocks a queued engine step may still write
            self.stream.after_engine()
        with self.stream.context():
            checksum = readback(payload_checksum_async(payload)) if trailer is not None else None
            if staging is not None and self.install is None:
                ids = ids_tensor(dest_blocks, self.kv_cache.device)
                self._unpack_local(staging, ids, src)
        if trailer is not None:
            try:
                sent = await asyncio.wait_for(trailer, self.config.lease_request_timeout_s)
            except Exception as exc:
                raise KvTransferError(
                    "peer_failed", f"no checksum after the KV payload: {exc}", payload_started=True
                ) from exc
        await self.stream.wait()
        if checksum is not None and (
            to_u64(checksum) != sent.checksum or sent.payload_bytes != payload.nbytes
        ):
            raise KvTransferError(
                "checksum",
                "KV payload failed its checksum (corrupted or truncated); it was discarded",
            )
        if self.install is not None:  # verified first: garbage never reaches another rank
            await self.install(staging, list(dest_blocks), src.head_start, src.head_end)

    async def _receive(self, ep, buffers: list) -> None:
        # all receives posted at once: UCX matches them in order and overlaps the messages
        await recv_all(ep, buffers, self.config.data_timeout_s, PAYLOAD_TAG)

    def close(self) -> None:
        for task in list(self._tails):
            task.cancel()
        self.pool.close()
