"""The decode half of a Generate call: the Decode stream, its one retry, the lease hand-off.

    choose decode worker (same model compat hash) ──Decode(timeout = time left)──▶ token chunks
        │ UNAVAILABLE before its first chunk: evict it, retry once on another decode worker
        │ first decode chunk: the KV was pulled (the pull released the lease), or kv_recomputed:
        │ release the lease (routing.release_lease_after_decode: always, as a safety net)
        │ failure after tokens were sent: UNAVAILABLE, never a silent replay
    last chunk: finish reason, usage

Colocated (no prefill ran): Decode carries the prompt and sampling with no kv and no
first_token_id, and TTFT is observed at the first decode chunk. Generation (generation.py)
runs the prefill first and then this; the state and cleanup both share are generation_base.py.
"""

from __future__ import annotations

import logging
import time

import grpc

from splitserve.protos import generate_pb2, worker_pb2
from splitserve.request.errors import RequestError
from splitserve.router.generation_base import GenerationBase, worker_error
from splitserve.router.worker_state import DECODE, Worker

log = logging.getLogger(__name__)


class _DecodeRefused(Exception):
    """A Decode that failed UNAVAILABLE before its first chunk; `error` is what the client gets
    when no retry happens."""

    def __init__(self, error: RequestError, why: str) -> None:
        super().__init__(why)
        self.error = error
        self.why = why


class StreamFellBack(Exception):
    """A streamed Decode answered kv_stream_fallback: it delivered nothing, holds nothing."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DecodeStream(GenerationBase):
    """A Generate call's decode side; Generation adds the prefill and runs the whole call."""

    # ---- decode ------------------------------------------------------------------------------------
    async def _decode(self, first: worker_pb2.PrefillResponse | None, avoid: str = "") -> None:
        """Streams the decode side; `first` None: colocated, the decode worker makes the first token.
        A Decode refused UNAVAILABLE before its first chunk (the worker died or is draining; the
        lease is still ours) is retried once on another decode worker: nothing of it was sent.
        `avoid`: a decode worker to pass over while another is healthy (its pool was full)."""
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
        if avoid and any(x.address != avoid for x in self.ctx.registry.healthy(DECODE)):
            tried.append(avoid)
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
        call=None,
    ) -> None:
        """`call`: a Decode already under way (the streamed hand-over, stream_handover.py)."""
        if call is None:
            self.timer.decode_sent(time.monotonic(), colocated=first is None)
            call = w.stub.Decode(decode_req, timeout=self._timeout())
        self.live.call = call
        w.in_flight += 1
        try:
            async for resp in call:
                if resp.kv_stream_fallback and not self.decode_took_lease:
                    self.timer.stream_fell_back(resp)
                    raise StreamFellBack(resp.kv_stream_fallback)
                if not self.decode_took_lease:  # the KV is pulled once tokens come
                    self.decode_took_lease = True
                    self.timer.decode_started(resp)
                    if first is None:  # colocated: no transfer
                        self._observe_components(decode_queue=resp.queue_time_ms)
                    elif resp.kv_streamed:  # overlapped with the prefill: not part of any sum
                        self._observe_components(
                            transfer_streamed=resp.transfer_time_ms,
                            decode_queue=resp.queue_time_ms,
                        )
                    else:
                        self._observe_components(
                            transfer=resp.transfer_time_ms, decode_queue=resp.queue_time_ms
                        )
                    if decode_req.HasField("kv") or decode_req.HasField("kv_stream"):
                        self.kv_handover = generate_pb2.KvHandover(  # in the client's last chunk
                            recomputed=resp.kv_recomputed,
                            reason=resp.kv_recompute_reason,
                            transfer_ms=resp.transfer_time_ms,
                            streamed=resp.kv_streamed,
                            stream_fallback=self.stream_fallback,
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
