"""The streamed hand-over, router side: Decode goes out as soon as the prefill worker is chosen.

    choose prefill worker P, then decode worker D (same model, both GetLoad.kv_streaming;
    a tensor-parallel P's shard map, GetLoad.kv_shards, goes along: D streams every rank)
    ──Decode(kv_stream = P's KV listener, no first token)──▶ D   reserves blocks (waits while
    ──Prefill──▶ P                                               full), streams P's KV as it is
    P's reply: first token to the client (TTFT), lease kept      computed; first token in the
    D's stream: tokens 2.. (its first step ran once the last     stream's last message
                 piece landed; P released the lease then)

Falls back to the pull after the prefill (decode_stream.py) when streaming is off or a worker
does not stream (an older version), when the prefill is retried on another worker
(D's stream is cancelled), and when D answers `kv_stream_fallback` (its stream failed before
delivering; the lease is untouched: after `pool_full`, its blocks never freed within
kv_transfer.stream_reserve_wait_s, the pull goes to another decode worker where one is healthy)
or fails UNAVAILABLE before its first chunk. A first token
that ends the request, or any failure, cancels D's call; D gives its blocks back.
"""

from __future__ import annotations

import logging
import secrets
import time

from splitserve.protos import worker_pb2
from splitserve.request.errors import RequestError
from splitserve.router.decode_stream import DecodeStream, StreamFellBack, _DecodeRefused
from splitserve.router.worker_state import DECODE, Worker

log = logging.getLogger(__name__)


class StreamedHandover(DecodeStream):
    """Adds the streamed Decode to a Generate call (Generation runs it)."""

    streamed: tuple[Worker, Worker, object, worker_pb2.DecodeRequest] | None = None
    stream_token = ""  # the secret both workers get for this request's stream (kv.proto)

    def _start_stream(self, prefill: Worker) -> None:
        """Launches the streamed Decode for a prefill on `prefill`, where both sides stream."""
        if not self.ctx.cfg.routing.kv_streaming or not prefill.load.kv_streaming:
            return
        addr = prefill.load.kv_address
        if not addr.port:
            return
        req = self.req
        compat = prefill.load.model_compat_hash
        try:
            w = self.ctx.registry.choose(
                DECODE, self.ctx.decode_policy, req.prompt, compat_hash=compat
            )
        except RequestError:
            return  # the pull after the prefill reports it, with its own retry
        if not w.load.kv_streaming:
            return
        self.stream_token = secrets.token_hex(16)
        source = worker_pb2.KvStreamSource(
            address=addr,
            model_compat_hash=compat,
            token=self.stream_token,
            shards=prefill.load.kv_shards,  # tensor parallel: one stream per prefill rank
        )
        decode_req = worker_pb2.DecodeRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt,
            sampling=req.sampling,
            kv_stream=source,
        )
        self.timer.decode_sent(time.monotonic(), colocated=False)
        call = w.stub.Decode(decode_req, timeout=self._timeout())  # starts at once
        self.streamed = (prefill, w, call, decode_req)

    def _drop_stream(self) -> None:
        """Cancels a streamed Decode that will not be read (its worker frees its blocks)."""
        if self.streamed is not None:
            _, _, call, _ = self.streamed
            self.streamed = None
            if not call.done():
                call.cancel()

    async def _decode_after_prefill(
        self, prefill: Worker, first: worker_pb2.PrefillResponse
    ) -> None:
        """The decode side once the first token went out: the streamed Decode when one runs for
        this prefill worker, else (or when it falls back) the pull after the prefill."""
        if self.streamed is None or self.streamed[0] is not prefill:
            self._drop_stream()
            await self._decode(first)
            return
        _, w, call, decode_req = self.streamed
        self.streamed = None
        try:
            await self._decode_on(w, decode_req, first, call=call)
            return
        except StreamFellBack as fb:
            self.stream_fallback = fb.reason
        except _DecodeRefused as refused:
            others = [x for x in self.ctx.registry.healthy(DECODE) if x.address != w.address]
            if not (self.ctx.cfg.routing.decode_retry and others):
                raise refused.error from None
            self.stream_fallback = "decode_unavailable"
            log.warning(
                "%s: streamed decode on %s UNAVAILABLE (%s); pulling after the prefill",
                self.req.request_id,
                w.address,
                refused.why,
            )
        self.ctx.metrics.stream_fallbacks.labels(self.stream_fallback).inc()
        # backpressure: a decode worker whose pool stayed full is passed over where another is
        full = w.address if self.stream_fallback == "pool_full" else ""
        await self._decode(first, avoid=full)
