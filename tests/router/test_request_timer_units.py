"""RequestTimer's split of the second token's gap, driven with chosen times (no processes): the
parts add up to the gap, and a first decode step that began before token 1 was written (a
streamed hand-over under a slow delivery) counts only with its part inside the gap."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from splitserve.protos import worker_pb2
from splitserve.router.request_timings import RequestTimer

GAP_PARTS = ("handover_ms", "first_decode_step_ms", "second_token_delivery_ms")


def _timer() -> RequestTimer:
    hist = Histogram("t_seconds", "test", ["component"], registry=CollectorRegistry())
    return RequestTimer(arrival=100.0, hist=hist)


def _disaggregated(first_write: float, second_write: float, transfer_ms: float, step_ms: float):
    t = _timer()
    t.decode_sent(100.001, colocated=False)  # streamed: before the Prefill
    t.prefill_sent(100.002)
    t.prefill_replied(worker_pb2.PrefillResponse(queue_time_ms=1.0, compute_time_ms=5.0))
    t.decode_started(worker_pb2.DecodeResponse(transfer_time_ms=transfer_ms, queue_time_ms=step_ms))
    t.tokens_written(1, first_write)
    t.tokens_written(1, second_write)
    return t.message


@pytest.mark.parametrize(
    "first_write, second_write, transfer_ms, step_ms",
    [
        (100.010, 100.020, 2.0, 3.0),  # step wholly inside a 10 ms gap
        (100.010, 100.01141, 0.5, 3.57),  # stop 26's CI figures: step began before token 1 went out
        (100.010, 100.0101, 0.0, 50.0),  # a step far longer than the gap
    ],
)
def test_gap_parts_never_exceed_the_gap(first_write, second_write, transfer_ms, step_ms):
    m = _disaggregated(first_write, second_write, transfer_ms, step_ms)
    gap = (second_write - first_write) * 1000
    assert m.second_token_gap_ms == pytest.approx(gap)
    parts = {k: getattr(m, k) for k in GAP_PARTS}
    assert all(v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(gap, abs=1e-6), (parts, gap)
    assert m.first_decode_step_ms == pytest.approx(min(step_ms, gap))


def test_a_step_inside_the_gap_is_reported_whole_and_the_rest_is_handover_or_delivery():
    # decode call 19 ms old at the second token: 2 transfer + 3 step + 14 network/handling
    m = _disaggregated(100.010, 100.020, transfer_ms=2.0, step_ms=3.0)
    assert m.first_decode_step_ms == pytest.approx(3.0)
    # 7 ms of the gap is neither the step nor hidden: delivery takes it up to the call's overhead
    assert m.second_token_delivery_ms == pytest.approx(7.0, abs=1e-6)
    assert m.handover_ms == pytest.approx(0.0, abs=1e-6)


def test_reserve_wait_is_reported_beside_the_gap_parts_and_a_fallback_adds_its_own():
    t = _timer()
    t.decode_sent(100.001, colocated=False)
    t.stream_fell_back(worker_pb2.DecodeResponse(kv_stream_fallback="pool_full", reserve_wait_ms=4))
    t.decode_started(worker_pb2.DecodeResponse(transfer_time_ms=3.0, reserve_wait_ms=1.5))
    t.tokens_written(1, 100.010)
    t.tokens_written(1, 100.020)
    m = t.message
    assert m.reserve_wait_ms == pytest.approx(5.5)
    parts = sum(getattr(m, k) for k in GAP_PARTS)
    assert parts == pytest.approx(m.second_token_gap_ms, abs=1e-6)  # not a term of the sum
    assert _disaggregated(100.010, 100.020, 2.0, 3.0).reserve_wait_ms == 0
