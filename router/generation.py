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

This module runs the call and its prefill; the decode stream is decode_stream.py, the state,
chunk writing, deadlines and cleanup both halves use are generation_base.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from splitserve.protos import generate_pb2, worker_pb2
from splitserve.request.errors import RequestError
from splitserve.router.generation_base import worker_error
from splitserve.router.stream_handover import StreamedHandover
from splitserve.router.worker_state import PREFILL, Worker

log = logging.getLogger(__name__)

# A client whose deadline passes cancels the call a little before the server's copy of the
# deadline (started when the request arrived) runs out; a cancel this close to it counts as one.
DEADLINE_SLACK_S = 0.25


class Generation(StreamedHandover):
    """One Generate call: prefill, first chunk, then the decode stream (decode_stream.py), or
    the streamed hand-over's Decode launched with the prefill (stream_handover.py)."""

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
            self._drop_stream()
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
        self.timer.prefill_replied(first)  # its parts are observed as the chunk goes out
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
        await self._decode_after_prefill(worker, first)

    # ---- prefill -----------------------------------------------------------------------------------
    async def _prefill(self) -> tuple[Worker, worker_pb2.PrefillResponse]:
        reg, req = self.ctx.registry, self.req
        attempts = 2 if self.ctx.cfg.routing.prefill_retry else 1
        tried: list[str] = []
        while True:
            w = reg.choose(PREFILL, self.ctx.prefill_policy, req.prompt, exclude=tried)
            if tried:  # a retry: the streamed Decode (if any) named the first worker
                self._drop_stream()
            else:
                self._start_stream(w)
            tried.append(w.address)
            self.timer.prefill_sent(time.monotonic())
            call = w.stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=req.request_id,
                    prompt_token_ids=req.prompt,
                    sampling=req.sampling,
                    kv_stream_token=self.stream_token if self.streamed is not None else "",
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
