"""One Generate call downstream of validation: prefill, first chunk, decode stream.

    choose prefill worker ──Prefill(timeout = time left)──▶ first token + KvHandle (lease)
        │ UNAVAILABLE before a reply: evict it, Abort there (best effort), retry once elsewhere
        │ cancelled or past its deadline: Abort there too (a reply with a lease may be on the wire)
    write the first chunk at once (TTFT does not wait for the decode side)
        │ finished already (eos, stop token, stop string, max_tokens)? release the lease, done
    choose decode worker (same model compat hash) ──Decode(timeout = time left)──▶ token chunks
        │ UNAVAILABLE before its first chunk: evict it, retry once on another decode worker
        │ first decode chunk: the KV was pulled (the pull released the lease), or kv_recomputed:
        │ release the lease (routing.release_lease_after_decode: always, as a safety net)
        │ failure after tokens were sent: UNAVAILABLE, never a silent replay
    last chunk: finish reason, usage

Colocated (routing.colocated, no prefill workers): no Prefill; Decode(prompt, sampling) goes
out with no kv and no first_token_id, the decode worker computes the prompt and streams the
first token itself; TTFT is observed at the first decode chunk, no prompt token is cached.

Every exit path (client cancel, deadline, Abort, worker failure) ends the worker calls
(cancelling a grpc.aio call cancels it on the worker) and releases a lease the decode side
has not taken, from a background task, so the release happens even while this call is
being cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from splitserve.protos import generate_pb2, worker_pb2
from splitserve.request.errors import RequestError
from splitserve.router.context import RouterContext
from splitserve.router.intake import PreparedRequest
from splitserve.router.output import OutputStream
from splitserve.router.registry import DECODE, PREFILL, Worker

log = logging.getLogger(__name__)

_PASS_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION,
}
# A client whose deadline passes cancels the call a little before the server's copy of the
# deadline (started when the request arrived) runs out; a cancel this close to it counts as one.
DEADLINE_SLACK_S = 0.25
_OUTCOME = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


class _DecodeRefused(Exception):
    """A Decode that failed UNAVAILABLE before its first chunk; `error` is what the client gets
    when no retry happens."""

    def __init__(self, error: RequestError, why: str) -> None:
        super().__init__(why)
        self.error = error
        self.why = why


class LiveRequest:
    """An in-flight request as Abort sees it: a flag and the worker call to cancel."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.aborted = False
        self.call: grpc.aio.Call | None = None

    def abort(self) -> None:
        self.aborted = True
        if self.call is not None:
            self.call.cancel()


def worker_error(
    stage: str, w: Worker, err: grpc.aio.AioRpcError, tokens_sent: int = 0
) -> RequestError:
    code, details = err.code(), err.details()
    if tokens_sent:
        return RequestError.unavailable(
            f"{stage} worker {w.address} failed after {tokens_sent} tokens were streamed ({code.name}: {details}); "
            "the stream cannot be resumed, send the request again"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestError(
            code,
            f"the request's deadline passed during {stage} on {w.address}; "
            "give the call a longer timeout or ask for fewer tokens",
        )
    if code not in _PASS_THROUGH:
        return RequestError.unavailable(
            f"{stage} worker {w.address} failed ({code.name}: {details}); retry"
        )
    return RequestError(code, f"{stage} worker {w.address}: {details}")


class Generation:
    def __init__(
        self,
        ctx: RouterContext,
        req: PreparedRequest,
        live: LiveRequest,
        context: grpc.aio.ServicerContext,
        arrival: float,
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.live = live
        self.context = context
        self.arrival = arrival
        self.out = OutputStream(ctx.model, req)
        self.lease: tuple[Worker, str] | None = None  # prefill worker, lease id
        self.decode_took_lease = False
        self.outcome = "cancelled"  # what a cancellation leaves; set on every other end
        self._last_token_write: float | None = None

    # ---- the whole call -----------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not (self.live.aborted and task is not None and task.cancelling() == 0):
                left = self._time_left()
                if left is not None and left < DEADLINE_SLACK_S:  # the client's clock ran out first
                    self.outcome = "deadline_exceeded"
                raise  # the client cancelled or its deadline passed: nobody to write to
            await self._finish(
                self.out.end(None, generate_pb2.FINISH_REASON_ABORT)
            )  # our Abort RPC
        finally:
            if not self.decode_took_lease:
                self._release_lease("request_ended")

    async def _run(self) -> None:
        if self.live.aborted:
            await self._finish(self.out.end(None, generate_pb2.FINISH_REASON_ABORT))
            return
        if self.ctx.cfg.routing.colocated:
            await self._decode(None)
            return
        worker, first = await self._prefill()
        if first.HasField("kv") and first.kv.lease_id:
            self.lease = (worker, first.kv.lease_id)
        self.out.cached_prompt_tokens = first.cached_prompt_tokens
        chunk = self.out.add([first.first_token_id], [first.first_token_logprob])
        if not self.out.finished and first.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            self.out.end(
                chunk,
                first.finish_reason,
                first.stop_reason if first.HasField("stop_reason") else None,
            )
        self.ctx.metrics.ttft_seconds.observe(time.monotonic() - self.arrival)
        self._observe_components(
            prefill_queue=first.queue_time_ms, prefill_compute=first.compute_time_ms
        )
        if self.out.finished:
            await self._finish(chunk)
            return
        await self._write(chunk)
        if self.live.aborted:
            await self._finish(self.out.end(None, generate_pb2.FINISH_REASON_ABORT))
            return
        if self.lease is None:
            raise RequestError.unavailable(
                f"prefill worker {worker.address} returned neither a finish reason nor "
                "a KvHandle; check that it runs this splitserve version"
            )
        await self._decode(first)

    # ---- prefill -----------------------------------------------------------------------------------
    async def _prefill(self) -> tuple[Worker, worker_pb2.PrefillResponse]:
        reg, req = self.ctx.registry, self.req
        attempts = 2 if self.ctx.cfg.routing.prefill_retry else 1
        tried: list[str] = []
        while True:
            w = reg.choose(PREFILL, self.ctx.prefill_policy, req.prompt, exclude=tried)
            tried.append(w.address)
            call = w.stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=req.request_id, prompt_token_ids=req.prompt, sampling=req.sampling
                ),
                timeout=self._timeout(),
            )
            self.live.call = call
            w.in_flight += 1
            try:
                return w, await call
            except asyncio.CancelledError:
                self._abort_on(
                    w
                )  # its reply, and the lease in it, may be on the wire: drop them there
                raise
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    if err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                        self._abort_on(w)  # as above
                    raise worker_error("prefill", w, err) from None
                reg.report_failure(w, f"Prefill failed: UNAVAILABLE ({err.details()})")
                self._abort_on(w)  # in case the request got through before the failure
                others = [x for x in reg.healthy(PREFILL) if x.address not in tried]
                if len(tried) >= attempts or not others:
                    raise worker_error("prefill", w, err) from None
                self.ctx.metrics.prefill_retries.inc()
                log.warning(
                    "%s: prefill on %s UNAVAILABLE (%s); retrying on another worker",
                    req.request_id,
                    w.address,
                    err.details(),
                )
            finally:
                w.in_flight -= 1
                self.live.call = None

    # ---- decode ------------------------------------------------------------------------------------
    async def _decode(self, first: worker_pb2.PrefillResponse | None) -> None:
        """Streams the decode side; `first` None: colocated, the decode worker makes the first token.
        A Decode refused UNAVAILABLE before its first chunk (the worker died or is draining; the
        lease is still ours) is retried once on another decode worker: nothing of it was sent."""
        req = self.req
        if first is None:
            compat = ""
            decode_req = worker_pb2.DecodeRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt, sampling=req.sampling
            )
        else:
            compat = first.kv.model_compat_hash or self.lease[0].load.model_compat_hash
            decode_req = worker_pb2.DecodeRequest(
                request_id=req.request_id,
                prompt_token_ids=req.prompt,
                first_token_id=first.first_token_id,
                sampling=req.sampling,
                kv=first.kv,
            )
        tried: list[str] = []
        while True:
            w = self.ctx.registry.choose(
                DECODE, self.ctx.decode_policy, req.prompt, exclude=tried, compat_hash=compat
            )
            tried.append(w.address)
            try:
                await self._decode_on(w, decode_req, first)
                return
            except _DecodeRefused as refused:
                others = [x for x in self.ctx.registry.healthy(DECODE) if x.address not in tried]
                if not (self.ctx.cfg.routing.decode_retry and len(tried) < 2 and others):
                    raise refused.error from None
                log.warning(
                    "%s: decode on %s UNAVAILABLE before its first chunk (%s); retrying on another worker",
                    req.request_id,
                    w.address,
                    refused.why,
                )

    async def _decode_on(
        self,
        w: Worker,
        decode_req: worker_pb2.DecodeRequest,
        first: worker_pb2.PrefillResponse | None,
    ) -> None:
        call = w.stub.Decode(decode_req, timeout=self._timeout())
        self.live.call = call
        w.in_flight += 1
        try:
            async for resp in call:
                if not self.decode_took_lease:  # the KV is pulled once tokens come
                    self.decode_took_lease = True
                    if first is None:  # colocated: no transfer
                        self._observe_components(decode_queue=resp.queue_time_ms)
                    else:
                        self._observe_components(
                            transfer=resp.transfer_time_ms, decode_queue=resp.queue_time_ms
                        )
                    if resp.kv_recomputed:  # the decode worker never took the lease: free it now
                        self._release_lease("kv_recomputed")
                    elif self.ctx.cfg.routing.release_lease_after_decode:
                        self._release_lease("decode_started")
                if first is None and resp.token_ids and not self.out.num_tokens:
                    self.ctx.metrics.ttft_seconds.observe(time.monotonic() - self.arrival)
                chunk = self.out.add(resp.token_ids, resp.logprobs)
                if (
                    not self.out.finished
                    and resp.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
                ):
                    self.out.end(
                        chunk,
                        resp.finish_reason,
                        resp.stop_reason if resp.HasField("stop_reason") else None,
                    )
                if self.out.finished:
                    await self._finish(chunk)
                    return
                if chunk.token_ids or chunk.text:
                    await self._write(chunk)
            raise RequestError.unavailable(
                f"decode worker {w.address} ended the stream without a finish reason after "
                f"{self.out.num_tokens} tokens; the stream cannot be resumed, send the request again"
            )
        except grpc.aio.AioRpcError as err:
            error = worker_error("decode", w, err, tokens_sent=self.out.num_tokens)
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self.ctx.registry.report_failure(w, f"Decode failed: UNAVAILABLE ({err.details()})")
                if not self.decode_took_lease:
                    raise _DecodeRefused(error, err.details()) from None
            raise error from None
        finally:
            w.in_flight -= 1
            self.live.call = None
            if not call.done():
                call.cancel()

    def _observe_components(self, **ms: float) -> None:
        hist = self.ctx.metrics.ttft_component_seconds
        for component, value in ms.items():
            hist.labels(component).observe(max(0.0, value) / 1000)

    # ---- writing -----------------------------------------------------------------------------------
    async def _write(self, chunk: generate_pb2.GenerateResponse) -> None:
        if chunk.token_ids:
            now = time.monotonic()
            if self._last_token_write is not None:
                self.ctx.metrics.itl_seconds.observe(now - self._last_token_write)
            self._last_token_write = now
            self.ctx.metrics.completion_tokens.inc(len(chunk.token_ids))
        await self.context.write(chunk)

    async def _finish(self, chunk: generate_pb2.GenerateResponse) -> None:
        await self._write(chunk)
        self.outcome = _OUTCOME[chunk.finish_reason]
        self.ctx.metrics.e2e_seconds.observe(time.monotonic() - self.arrival)

    # ---- deadlines and cleanup -----------------------------------------------------------------------
    def _time_left(self) -> float | None:
        left = self.context.time_remaining()
        return None if left is None else max(0.0, left)

    def _timeout(self) -> float | None:
        left = self._time_left()
        if left == 0.0:
            raise RequestError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the request's deadline passed before a worker was called; give it a longer timeout",
            )
        return left

    def _release_lease(self, reason: str) -> None:
        if self.lease is None:
            return
        w, lease_id = self.lease
        self.lease = None
        rid, timeout, metric = (
            self.req.request_id,
            self.ctx.cfg.worker_call_timeout_s,
            self.ctx.metrics,
        )

        async def release() -> None:
            got = await w.stub.ReleaseLease(
                worker_pb2.ReleaseLeaseRequest(lease_id=lease_id, request_id=rid), timeout=timeout
            )
            if got.released:
                metric.leases_released.labels(reason).inc()

        self.ctx.background.spawn(release(), f"ReleaseLease {lease_id} of {rid} on {w.address}")

    def _abort_on(self, w: Worker) -> None:
        rid = self.req.request_id
        self.ctx.background.spawn(
            w.stub.Abort(
                generate_pb2.AbortRequest(request_id=rid),
                timeout=self.ctx.cfg.worker_call_timeout_s,
            ),
            f"Abort {rid} on {w.address}",
        )
