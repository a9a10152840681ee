"""What both halves of a Generate call (prefill in generation.py, decode in decode_stream.py) share.

The call's state (request, output stream, the prefill worker's lease, outcome), writing chunks
to the client with their metrics (ITL, completion tokens, end-to-end latency), the time left
before the client's deadline, and the cleanup that must outlive a cancelled call: releasing a
lease and Aborting on a worker both go out from background tasks. Also what a failed worker
call becomes for the client (`worker_error`) and the handle Abort uses (`LiveRequest`).
"""

from __future__ import annotations

import time

import grpc

from splitserve.protos import generate_pb2, worker_pb2
from splitserve.request.errors import RETRY_AFTER_MS, RequestError
from splitserve.router.context import RouterContext
from splitserve.router.intake import PreparedRequest
from splitserve.router.output import OutputStream
from splitserve.router.request_timings import RequestTimer
from splitserve.router.worker_state import Worker

_PASS_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION,
}
_OUTCOME = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


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
    if tokens_sent and code == grpc.StatusCode.INVALID_ARGUMENT:
        # the request itself, found mid-stream (a constraint past the grammar engine's limits):
        # sending it again fails the same way, so not UNAVAILABLE
        return RequestError.invalid(
            f"{stage} worker {w.address} refused the request after {tokens_sent} tokens were "
            f"streamed: {details}"
        )
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
    hint = _retry_after_s(err) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
    return RequestError(code, f"{stage} worker {w.address}: {details}", hint)


def _retry_after_s(err: grpc.aio.AioRpcError) -> float | None:
    """The worker's `retry-after-ms` hint (a full queue), passed on to the client; None when it
    sent none (a request too big for its pool: retrying cannot help)."""
    for key, value in err.trailing_metadata() or ():
        if key == RETRY_AFTER_MS:
            try:
                return max(int(value), 1) / 1000
            except ValueError:
                return None
    return None


class GenerationBase:
    """The state and shared steps of one Generate call; Generation runs it."""

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
        self.stream_fallback = ""  # why a streamed hand-over fell back to the pull (if it did)
        self.kv_handover: generate_pb2.KvHandover | None = None  # set by a decode after a pull
        self.outcome = "cancelled"  # what a cancellation leaves; set on every other end
        self._last_token_write: float | None = None
        self.timer = RequestTimer(arrival, ctx.metrics.ttft_component_seconds)

    # ---- writing -----------------------------------------------------------------------------------
    async def _write(self, chunk: generate_pb2.GenerateResponse, last: bool = False) -> None:
        if chunk.token_ids:
            now = time.monotonic()
            if self._last_token_write is not None:
                self.ctx.metrics.itl_seconds.observe(now - self._last_token_write)
            self._last_token_write = now
            self.ctx.metrics.completion_tokens.inc(len(chunk.token_ids))
            self.timer.tokens_written(len(chunk.token_ids), now)
        if last and self.timer.first_token_sent:  # the whole request's timings, once
            chunk.timings.CopyFrom(self.timer.message)
        await self.context.write(chunk)

    async def _finish(self, chunk: generate_pb2.GenerateResponse) -> None:
        if self.kv_handover is not None:
            chunk.kv_handover.CopyFrom(self.kv_handover)
        await self._write(chunk, last=True)
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

    # ---- TTFT components (the rest: request_timings.py) ----------------------------------------------
    def _observe_components(self, **ms: float) -> None:
        hist = self.ctx.metrics.ttft_component_seconds
        for component, value in ms.items():
            hist.labels(component).observe(max(0.0, value) / 1000)
