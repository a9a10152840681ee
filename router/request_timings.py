"""Where one request's TTFT and first inter-token gap went (GenerateResponse.timings).

    arrival ── router_queue ──▶ Prefill sent ─┬─ prefill_queue ─ prefill_compute ─┬─▶ first chunk
                                              └──── first_token_delivery: the rest ┘   (TTFT)
    first chunk ── handover ── first_decode_step ── second_token_delivery ──▶ second token's chunk

Each figure is a duration on one process's own monotonic clock: the router's elapsed times
(this module) and the workers' reported durations (PrefillResponse queue / compute / sampling,
DecodeResponse transfer / queue / admit_wait / local_prefill). Network and handling time is what
the router's elapsed time holds beyond the worker's durations; no timestamp of one process is
ever set against another's. Colocated (no prefill worker), the decode worker's queue and its own
prefill of the prompt fill prefill_queue and prefill_compute, and the whole gap is its first
decode step. The parts are clamped at 0; unclamped they add up to the router's TTFT and gap. A
first decode step that began before token 1 was written (a streamed hand-over brings the decode
worker the first token early) counts only with its part inside the gap, so the gap's parts
never add up to more than the gap. reserve_wait (the decode worker's wait for room in its block
pool, backpressure on a streamed hand-over) is reported beside the parts, not as one of them: it
overlaps the prefill, and what of it outlasted the prefill is inside handover.

The TTFT parts are observed in `splitserve_router_ttft_component_seconds` when the first token's
chunk is written, the gap's when the second token's is; the client gets them all on the last chunk.
"""

from __future__ import annotations

from prometheus_client import Histogram

from splitserve.protos import generate_pb2, worker_pb2


class RequestTimer:
    """One Generate call's timings; the Generation calls it at each step (times: monotonic s)."""

    def __init__(self, arrival: float, hist: Histogram) -> None:
        self._arrival = arrival
        self._hist = hist
        # the call that makes the first token went out (Prefill, or the colocated Decode)
        self._first_call_sent = arrival
        self._colocated = False
        self._worker_ttft_ms = (0.0, 0.0, 0.0)  # queue, compute, sampling on the worker
        self._decode_sent = 0.0
        self._decode_ms = (0.0, 0.0)  # the delivering Decode's transfer and queue (hand-over)
        self._first_write: float | None = None
        self._tokens = 0
        self.message = generate_pb2.RequestTimings()

    @property
    def first_token_sent(self) -> bool:
        return self._first_write is not None

    # ---- worker calls ------------------------------------------------------------------------------
    def prefill_sent(self, now: float) -> None:
        """A Prefill attempt went out (a retry moves it: the failed attempt is router time)."""
        self._first_call_sent = now

    def prefill_replied(self, resp: worker_pb2.PrefillResponse) -> None:
        self._worker_ttft_ms = (resp.queue_time_ms, resp.compute_time_ms, resp.sampling_time_ms)

    def decode_sent(self, now: float, colocated: bool) -> None:
        """A Decode went out (streamed: before the Prefill; a fallback or retry moves it)."""
        self._decode_sent = now
        if colocated:
            self._colocated = True
            self._first_call_sent = now

    def stream_fell_back(self, resp: worker_pb2.DecodeResponse) -> None:
        """A streamed Decode answered kv_stream_fallback: the wait for blocks it reports."""
        self.message.reserve_wait_ms += max(0.0, resp.reserve_wait_ms)

    def decode_started(self, resp: worker_pb2.DecodeResponse) -> None:
        """The Decode's first chunk (its timing fields)."""
        self.message.reserve_wait_ms += max(0.0, resp.reserve_wait_ms)
        if self._colocated:
            self._worker_ttft_ms = (resp.admit_wait_ms, resp.local_prefill_ms, 0.0)
        else:
            self._decode_ms = (resp.transfer_time_ms, resp.queue_time_ms)

    # ---- chunks to the client ----------------------------------------------------------------------
    def tokens_written(self, num_tokens: int, now: float) -> None:
        """A chunk with `num_tokens` tokens is about to be written to the client."""
        if self._first_write is None:
            self._first_write = now
            self._ttft_parts(now)
        if self._tokens < 2 <= self._tokens + num_tokens:
            self._gap_parts(now)
        self._tokens += num_tokens

    def _ttft_parts(self, now: float) -> None:
        m = self.message
        queue, compute, sampling = self._worker_ttft_ms
        m.router_queue_ms = max(0.0, self._first_call_sent - self._arrival) * 1000
        m.prefill_queue_ms = max(0.0, queue)
        m.prefill_compute_ms = max(0.0, compute)
        m.prefill_sampling_ms = max(0.0, sampling)
        call_ms = (now - self._first_call_sent) * 1000
        m.first_token_delivery_ms = max(0.0, call_ms - queue - compute)
        self._observe(
            router_queue=m.router_queue_ms,
            prefill_queue=m.prefill_queue_ms,
            prefill_compute=m.prefill_compute_ms,
            first_token_delivery=m.first_token_delivery_ms,
        )
        if not self._colocated:
            self._observe(prefill_sampling=m.prefill_sampling_ms)

    def _gap_parts(self, now: float) -> None:
        m = self.message
        gap_ms = (now - self._first_write) * 1000
        m.second_token_gap_ms = gap_ms
        if self._colocated:  # no hand-over: the gap is the worker's step after its own prefill
            m.first_decode_step_ms = gap_ms
        else:
            transfer, queue = self._decode_ms
            # streamed, the decode worker may start its first step while the router is still
            # writing token 1 (the stream brought it the first token): only the step's part
            # inside the gap is the gap's, the rest overlapped token 1's delivery
            step = min(max(0.0, queue), gap_ms)
            m.first_decode_step_ms = step
            # the delivering Decode's network and handling: its elapsed time up to this chunk
            # beyond what the worker reports; what the gap holds beyond that and the step is
            # the hand-over not hidden behind the prefill (streamed: most of `transfer` is)
            overhead = max(0.0, (now - self._decode_sent) * 1000 - transfer - queue)
            rest = max(0.0, gap_ms - step)
            delivery = min(overhead, rest)
            m.second_token_delivery_ms = delivery
            m.handover_ms = rest - delivery
        self._observe(
            handover=m.handover_ms,
            first_decode_step=m.first_decode_step_ms,
            second_token_delivery=m.second_token_delivery_ms,
        )

    def _observe(self, **ms: float) -> None:
        for component, value in ms.items():
            self._hist.labels(component).observe(value / 1000)
