"""A streamed hand-over on the decode side (DecodeRequest.kv_stream; protocol in
kvtransfer/layer_stream_server.py): reserve the prompt's blocks, then receive the KV while the
prefill worker computes it, and the first token with its last piece.

    reserve blocks (engine thread); pool short: wait, retried as blocks free up (backpressure,
        counted), up to kv_transfer.stream_reserve_wait_s
    stream pull (layer_stream_client.py): each layer group's piece lands in the blocks; a
        tensor-parallel prefill: one stream per rank, rank 0's confirmed last
        (kvtransfer/layer_stream_shards.py)
    final piece: first token (+ lease released on the prefill side) -> submit(input, blocks)

Any failure before the final piece gives the blocks back and raises `StreamFallback`: the
servicer answers with `kv_stream_fallback`, and the router sends the classic Decode (first token
and KvHandle: the prefill lease was not touched), which pulls or recomputes per
kv_transfer.failure_policy. An incompatible pool is FAILED_PRECONDITION, as for a pull.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from splitserve.decode_worker.config import DecodeFaults
from splitserve.decode_worker.engine_loop import EngineLoop
from splitserve.kvtransfer.errors import KvTransferError
from splitserve.kvtransfer.layer_stream_client import LayerStreamClient, StreamResult
from splitserve.kvtransfer.layer_stream_shards import stream_shards
from splitserve.kvtransfer.shards import shard_sources
from splitserve.protos import kv_pb2, worker_pb2
from splitserve.request.errors import RequestError

log = logging.getLogger(__name__)
_POLL_S = (0.001, 0.02)  # reservation retry: first and longest wait between tries


class StreamFallback(Exception):
    """The stream did not deliver; nothing is held. `reason` labels it for the router."""

    def __init__(self, reason: str, message: str, reserve_wait_s: float = 0.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.reserve_wait_s = reserve_wait_s  # how long it waited for blocks before it failed


class StreamPuller:
    def __init__(
        self,
        client: LayerStreamClient,
        reserve_wait_s: float,
        metrics,
        faults: DecodeFaults | None = None,
    ) -> None:
        self.client = client
        self.reserve_wait_s = reserve_wait_s
        self.metrics = metrics
        self.faults = faults or DecodeFaults()

    async def pull(
        self, request: worker_pb2.DecodeRequest, loop: EngineLoop
    ) -> tuple[list[int] | None, StreamResult, float]:
        """(blocks holding the prompt's KV, the stream's result with the first token, seconds
        spent waiting for room in the pool: backpressure, 0 when the blocks were free at once);
        None blocks when that first token already ended the request (nothing to decode)."""
        num_tokens = len(request.prompt_token_ids)
        num_blocks = -(-num_tokens // self.client.spec.block_size)
        src = request.kv_stream
        try:  # the shard map checked before any block is reserved
            sources = shard_sources(
                kv_pb2.KvHandle(
                    address=src.address,
                    shards=src.shards,
                    num_kv_heads=self.client.spec.num_kv_heads,
                )
            )
        except ValueError as exc:
            raise RequestError.invalid(f"kv_stream: {exc}".replace("kv.shards", "shards")) from None
        ids, waited_s = await self._reserve(loop, num_blocks, request.request_id)
        try:
            ids, result = await self._stream(request, loop, sources, num_tokens, ids)
        except StreamFallback as fb:
            fb.reserve_wait_s = waited_s
            raise
        return ids, result, waited_s

    async def _stream(
        self,
        request: worker_pb2.DecodeRequest,
        loop: EngineLoop,
        sources,
        num_tokens: int,
        ids: list[int],
    ) -> tuple[list[int] | None, StreamResult]:
        """The stream into the reserved `ids` (given back on any failure)."""
        src = request.kv_stream
        if delay := self.faults.pull_delay(request.request_id):  # tests only: held, blocks reserved
            try:
                await asyncio.sleep(delay)
            except BaseException:
                loop.release_blocks(ids)
                raise
        # its own task: a cancelled caller must not leave UCX writing into a buffer it freed; the
        # task ends on its own timeouts (or the endpoints' abort) and only then are blocks freed
        task = asyncio.ensure_future(
            stream_shards(self.client, sources, request.request_id, num_tokens, ids, src.token)
        )
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(
                lambda t: (t.cancelled() or t.exception(), loop.release_blocks(ids))
            )
            if not task.done():  # the blocks go back once its receive ended
                self.client.abort(request.request_id)
            raise
        except KvTransferError as exc:
            loop.release_blocks(ids)
            if exc.status == grpc.StatusCode.FAILED_PRECONDITION:
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION, f"kv_stream: {exc}"
                ) from None
            log.warning("%s: KV stream failed (%s: %s)", request.request_id, exc.reason, exc)
            raise StreamFallback(exc.reason, str(exc)) from None
        except BaseException:
            loop.release_blocks(ids)
            raise
        if result.finished:  # the first token ended the request: nothing to decode here
            loop.release_blocks(ids)
            return None, result
        return ids, result

    async def _reserve(
        self, loop: EngineLoop, num_blocks: int, request_id: str
    ) -> tuple[list[int], float]:
        """(the reserved blocks, seconds waited for them: 0 when the pool had room at once)."""
        start = time.perf_counter()
        wait = _POLL_S[0]
        waited = False
        while True:
            reserved = loop.reserve_blocks(num_blocks)
            try:
                ids = await asyncio.shield(asyncio.wrap_future(reserved))
            except asyncio.CancelledError:
                if not reserved.cancel():  # the engine thread took them already: give them back
                    reserved.add_done_callback(
                        lambda f: f.result() and loop.release_blocks(f.result())
                    )
                raise
            if ids is not None:
                took = time.perf_counter() - start
                self.metrics.kv_reserve_wait_seconds.observe(took)
                return ids, took if waited else 0.0
            if not waited:
                waited = True
                self.metrics.kv_reserve_waits.inc()
                log.info("%s: no room for %d blocks; waiting for them", request_id, num_blocks)
            if time.perf_counter() - start > self.reserve_wait_s:
                # not the pool_full failure: the pull after the prefill counts that if it recomputes
                raise StreamFallback(
                    "pool_full",
                    f"no room for {num_blocks} blocks within {self.reserve_wait_s:g}s",
                    time.perf_counter() - start,
                )
            await asyncio.sleep(wait)
            wait = min(2 * wait, _POLL_S[1])


def check_stream_request(
    request: worker_pb2.DecodeRequest, engine, streaming: bool, first: int | None
) -> None:
    """DecodeRequest.kv_stream validated before any block is reserved."""
    src = request.kv_stream
    if not streaming:
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this decode worker does not take streamed hand-overs (kv_transfer.streaming "
            "off); send kv and first_token_id instead",
        )
    if first is not None or (request.HasField("kv") and request.kv.lease_id):
        raise RequestError.invalid(
            "kv_stream is set with first_token_id or kv; a streamed hand-over gets the first "
            "token from the stream: send either kv_stream alone or kv with first_token_id"
        )
    if not src.address.host or not src.address.port:
        raise RequestError.invalid(
            "kv_stream.address needs the prefill worker's UCX host and port "
            "(its GetLoad kv_address)"
        )
    if src.model_compat_hash != engine.runner.compat_hash:
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"kv_stream: the prefill worker's model_compat_hash {src.model_compat_hash[:80]!r} "
            "differs from this worker's (GetLoad.model_compat_hash tells compatible workers)",
        )
