"""DecodeWorker gRPC servicer: proto in, validation, engine loop, streamed proto out.

KV hand-over: a request with a KvHandle is checked for compatibility (block size, layout,
dtype, geometry, model hash: a mismatch is FAILED_PRECONDITION before any block is
allocated), then its KV is pulled over UCX into freshly reserved blocks (kv_pull.py; a
delivered pull releases the prefill lease) and it joins the batch with the first token from
the host. A request without a handle, or whose pull failed under the `recompute` policy, is
served by recomputing the prompt locally. A request without `first_token_id` (colocated mode:
no prefill happened) has its prompt computed here and its first token sampled and streamed
by this worker. Stop strings are matched here, on the event loop, never on the engine thread
(stop_strings.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import grpc

from splitserve.decode_worker.engine_loop import EngineLoop
from splitserve.decode_worker.kv_pull import KvPuller
from splitserve.decode_worker.kv_stream_pull import (
    StreamFallback,
    StreamPuller,
    check_stream_request,
)
from splitserve.decode_worker.sequence import DecodeInput, StepOutput
from splitserve.decode_worker.stop_strings import StopStringFilter
from splitserve.kvtransfer.descriptor import KvIncompatibleError, PoolSpec, check_compatible
from splitserve.kvtransfer.shards import shard_sources
from splitserve.protos import generate_pb2, kv_pb2, worker_pb2, worker_pb2_grpc
from splitserve.request.errors import RequestError
from splitserve.service.proto_convert import (
    finish_reason_to_proto,
    logprob_to_proto,
    stop_reason_to_proto,
    validate_request,
)
from splitserve.service.request_ids import check_request_id

log = logging.getLogger(__name__)


def _merge(outs: list[StepOutput], want_logprobs: bool) -> worker_pb2.DecodeResponse:
    resp = worker_pb2.DecodeResponse()
    for out in outs:
        resp.token_ids.extend(out.token_ids)
        if want_logprobs:
            resp.logprobs.extend(logprob_to_proto(lp) for lp in out.logprobs if lp is not None)
    last = outs[-1]
    if last.finished:
        resp.finish_reason = finish_reason_to_proto(last.finish_reason)
        stop = stop_reason_to_proto(last.stop_reason)
        if stop is not None:
            resp.stop_reason.CopyFrom(stop)
    return resp


class _Outbox:
    """Carries StepOutputs from the engine thread to the event loop with one wake-up per
    batch of outputs (a step's worth), not one per token and request."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, StepOutput]] = []

    def sink(self, queue: asyncio.Queue):
        def put(out: StepOutput) -> None:
            with self._lock:
                self._pending.append((queue, out))
                if len(self._pending) > 1:  # a flush is already scheduled
                    return
            self._aio.call_soon_threadsafe(self._flush)

        return put

    def _flush(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        for queue, out in items:
            queue.put_nowait(out)


class DecodeWorkerServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self) -> None:
        self.loop: EngineLoop | None = None  # set once the model is loaded and the graphs captured
        self.puller: KvPuller | None = (
            None  # set after the graphs are captured (docs/architecture.md: capture before UCX)
        )
        self.streamer: StreamPuller | None = None  # streamed hand-overs (kv_stream_pull.py)
        self._outbox: _Outbox | None = None
        self._streams: dict[
            asyncio.Queue, str
        ] = {}  # open Decode calls: their output queue -> request id
        self.failed: RequestError | None = None  # set by fail_all: every call from then on gets it

    def fail_all(self, err: RequestError) -> None:
        """Ends every open Decode call with `err` now, without waiting for the engine thread (it
        may be stuck in a collective with a dead rank); new calls get it too. Event loop only."""
        self.failed = err
        for queue, request_id in list(self._streams.items()):
            queue.put_nowait(StepOutput(request_id, finish_reason="error", error=err))

    def _loop(self) -> EngineLoop:
        if self.failed is not None:
            raise self.failed
        if self.loop is None:
            raise RequestError.unavailable(
                "the decode worker is still loading its model and capturing graphs; "
                "retry when its health check says SERVING"
            )
        return self.loop

    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        try:
            loop = self._loop()
            inp = self._validate(request, loop)
            if inp.params.constraint is not None:  # compiled before any block is reserved
                matcher = await loop.engine.grammars.matcher(inp.params.constraint)
                inp = dataclasses.replace(inp, matcher=matcher)
        except RequestError as err:
            await err.abort(context)
        block_ids = None
        transfer_s = reserve_wait_s = 0.0
        recomputed, why, streamed = False, "", False
        if request.HasField("kv_stream"):  # the KV arrives while the prompt is prefilled
            start = time.perf_counter()
            try:
                block_ids, result, reserve_wait_s = await self.streamer.pull(request, loop)
            except StreamFallback as fb:  # nothing held: the router falls back to the pull
                yield worker_pb2.DecodeResponse(
                    kv_stream_fallback=fb.reason or "failed",
                    reserve_wait_ms=fb.reserve_wait_s * 1000,
                )
                return
            except RequestError as err:
                await err.abort(context)
            if block_ids is None:  # the first token ended it: the router finishes the request
                return
            transfer_s, streamed = time.perf_counter() - start, True
            inp = dataclasses.replace(inp, first_token_id=result.first_token_id)
        stops = (
            StopStringFilter(
                loop.engine.tokenizer, inp.prompt_token_ids, inp.params, inp.first_token_id
            )
            if inp.params.stop
            else None
        )
        if request.HasField("kv") and request.kv.lease_id and self.puller is not None:
            start = time.perf_counter()
            try:
                block_ids, why = await self.puller.pull(request.kv, loop)
            except RequestError as err:
                await err.abort(context)
            transfer_s = time.perf_counter() - start
            recomputed = block_ids is None
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        if self._outbox is None:
            self._outbox = _Outbox(asyncio.get_running_loop())
        if self.failed is not None:  # failed while this call pulled its KV
            if block_ids is not None:
                loop.release_blocks(block_ids)
            await self.failed.abort(context)
        self._streams[queue] = request.request_id
        submitted = time.monotonic()
        loop.submit(inp, self._outbox.sink(queue), block_ids)
        done = False
        first = True  # TTFT components go on the first chunk only
        started = None  # the engine's (admitted, first token) times, from its first output

        def timed(resp: worker_pb2.DecodeResponse) -> worker_pb2.DecodeResponse:
            nonlocal first
            if first:
                first = False
                resp.transfer_time_ms = transfer_s * 1000
                resp.reserve_wait_ms = reserve_wait_s * 1000
                resp.kv_recomputed = recomputed
                resp.kv_recompute_reason = why
                resp.kv_streamed = streamed
                resp.queue_time_ms = (first_out_at - submitted) * 1000
                if started is not None and started[0]:
                    admitted, produced = started
                    resp.admit_wait_ms = max(0.0, admitted - submitted) * 1000
                    if inp.first_token_id is None:  # colocated: this worker prefilled the prompt
                        resp.local_prefill_ms = max(0.0, produced - admitted) * 1000
            return resp

        try:
            while not done:
                outs = [await queue.get()]
                first_out_at = time.monotonic()
                if first:
                    started = outs[0].started
                while (
                    not queue.empty() and not outs[-1].finished
                ):  # the client fell behind: one chunk for all
                    outs.append(queue.get_nowait())  # (fail_all's error may come before a step's)
                if stops is not None:
                    outs = stops.apply(outs)
                    if stops.stopped is not None:  # the engine still runs it: end it there too
                        loop.abort(request.request_id, reason="stop")
                done = outs[-1].finished
                if done and outs[-1].error is not None:
                    err = outs[-1].error
                    if not isinstance(err, RequestError):
                        err = RequestError.unavailable(f"decode failed: {err!r}")
                    if len(outs) > 1:
                        yield timed(_merge(outs[:-1], inp.params.logprobs is not None))
                    await err.abort(context)
                yield timed(_merge(outs, inp.params.logprobs is not None))
        finally:
            self._streams.pop(queue, None)
            if (
                not done or self.failed is not None
            ):  # cancelled, deadline passed, server stopping, rank lost
                loop.abort(request.request_id)

    def _validate(self, request: worker_pb2.DecodeRequest, loop: EngineLoop) -> DecodeInput:
        engine = loop.engine
        check_request_id(request.request_id)
        params = validate_request(
            request.prompt_token_ids,
            request.sampling if request.HasField("sampling") else None,
            vocab_size=engine.vocab_size,
            max_model_len=engine.runner.max_model_len,
        )
        if params.stop and engine.tokenizer is None:
            raise RequestError.invalid(
                "stop strings need the worker's tokenizer, and this worker has none; use "
                "stop_token_ids or start the worker on a checkpoint with tokenizer.json"
            )
        first = request.first_token_id if request.HasField("first_token_id") else None
        if first is not None and first >= engine.vocab_size:
            raise RequestError.invalid(
                f"first_token_id {first} is outside the vocabulary "
                f"(size {engine.vocab_size}); pass the token the prefill worker returned"
            )
        if request.HasField("kv_stream"):
            check_stream_request(request, engine, self.streamer is not None, first)
        elif request.HasField("kv") and request.kv.lease_id:
            if first is None:
                raise RequestError.invalid(
                    "kv is set but first_token_id is not; pass the first token the prefill "
                    "worker returned with the handle (omit both for colocated decoding)"
                )
            self._check_handle(request.kv, len(request.prompt_token_ids), engine)
        # too big for the whole pool: RESOURCE_EXHAUSTED (no retry hint) before any KV is pulled
        engine.scheduler.check_fits(len(request.prompt_token_ids), params.max_tokens)
        return DecodeInput(request.request_id, list(request.prompt_token_ids), first, params)

    @staticmethod
    def _check_handle(kv: kv_pb2.KvHandle, prompt_len: int, engine) -> None:
        """A handle for another model, dtype, block size or layout is a deployment mistake
        (FAILED_PRECONDITION), caught before any block is allocated."""
        runner = engine.runner
        try:
            check_compatible(
                kv,
                PoolSpec.of(
                    runner.kv_cache, runner.compat_hash, runner.model_config.num_key_value_heads
                ),
            )
        except KvIncompatibleError as exc:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"kv: {exc} (GetLoad.model_compat_hash tells compatible workers)",
            ) from None
        if kv.num_tokens != prompt_len:
            raise RequestError.invalid(
                f"kv.num_tokens is {kv.num_tokens} but the prompt has {prompt_len} tokens; "
                "send the prompt the handle was made for"
            )
        if kv.num_blocks != -(-kv.num_tokens // kv.block_size):
            raise RequestError.invalid(
                f"kv.num_blocks is {kv.num_blocks} but {kv.num_tokens} tokens fill "
                f"{-(-kv.num_tokens // kv.block_size)} blocks of {kv.block_size}; "
                "pass the handle the prefill worker returned, unchanged"
            )
        if not kv.address.host or not 1 <= kv.address.port <= 65535:
            raise RequestError.invalid(
                "kv.address needs the prefill worker's UCX host and a port in 1..65535; "
                "pass the handle the prefill worker returned, unchanged"
            )
        try:
            shard_sources(kv)  # a tensor-parallel prefill's shard map must cover every head once
        except ValueError as exc:
            raise RequestError.invalid(str(exc)) from None

    async def Abort(
        self, request: generate_pb2.AbortRequest, context
    ) -> generate_pb2.AbortResponse:
        if self.loop is None:
            return generate_pb2.AbortResponse(found=False)
        found = await asyncio.wrap_future(self.loop.abort(request.request_id))
        return generate_pb2.AbortResponse(found=found)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context) -> worker_pb2.WorkerLoad:
        load = worker_pb2.WorkerLoad(role=generate_pb2.WORKER_ROLE_DECODE)
        if self.loop is None:
            return load
        engine = self.loop.engine
        snap = engine.load  # the last step's snapshot; never waits for a step
        load.num_running = snap.num_running
        load.num_waiting = snap.num_waiting
        load.free_blocks = snap.free_blocks
        load.total_blocks = snap.total_blocks
        load.block_size = engine.runner.block_size
        load.model_compat_hash = engine.runner.compat_hash
        load.kv_streaming = self.streamer is not None
        return load
