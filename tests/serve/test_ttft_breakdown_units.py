"""The bench's TTFT breakdown from per-request timings (cli/bench/ttft_breakdown.py): each part's
median and p99, its mean over the requests at the total's p99 (so a spike is explained by the
requests that made it), the client's hop as the rest of its TTFT, n/a without timings."""

from __future__ import annotations

import io

import pytest

from splitserve.cli.bench.metrics import per_request, summarize
from splitserve.cli.bench.report import print_summary
from splitserve.cli.bench.runner import RequestResult
from splitserve.cli.bench.ttft_breakdown import breakdowns, timings_ms
from splitserve.cli.bench.workload import BenchConfig
from splitserve.protos import generate_pb2


def _timed(i: int, ttft_ms: float, compute_ms: float, gap=None) -> RequestResult:
    msg = generate_pb2.RequestTimings(
        router_queue_ms=1.0,
        prefill_queue_ms=2.0,
        prefill_compute_ms=compute_ms,
        prefill_sampling_ms=0.5,
        first_token_delivery_ms=3.0,
    )
    if gap is not None:
        msg.second_token_gap_ms = gap
        msg.handover_ms, msg.first_decode_step_ms, msg.second_token_delivery_ms = (
            gap / 2,
            gap / 4,
            gap / 4,
        )
        msg.reserve_wait_ms = 1.0  # beside the parts: not a term of the gap's sum
    return RequestResult(
        i, ok=True, output_len=4, ttft_s=ttft_ms / 1e3, e2e_s=1.0, timings=timings_ms(msg)
    )


def test_parts_and_the_spike_at_p99():
    # 99 requests with 10 ms of compute, one spike of 500 ms: its own parts explain the p99
    results = [_timed(i, 20.0, 10.0, gap=8.0) for i in range(99)]
    results.append(_timed(99, 520.0, 500.0))  # ended at its first token: no gap parts
    ttft, token2 = breakdowns(results)
    assert list(ttft) == [
        "router_queue",
        "prefill_queue",
        "prefill_compute",
        "prefill_sampling",
        "first_token_delivery",
        "client_hop",
    ]
    assert ttft["prefill_compute"]["median"] == pytest.approx(10.0)
    assert ttft["prefill_compute"]["at_p99"] == pytest.approx(500.0)  # the spike's own figure
    assert ttft["client_hop"]["median"] == pytest.approx(20.0 - (1 + 2 + 10 + 3))
    spike = sum(s["at_p99"] for k, s in ttft.items() if k != "prefill_sampling")
    assert spike == pytest.approx(520.0, rel=1e-6)  # the parts add up to the spike's TTFT
    assert token2["second_token_gap"]["median"] == pytest.approx(8.0)
    assert token2["handover"]["p99"] == pytest.approx(4.0)
    assert set(token2["first_decode_step"]) == {"median", "p99", "at_p99"}
    assert token2["reserve_wait"]["median"] == pytest.approx(1.0)


def test_client_hop_is_never_negative_and_failed_requests_are_left_out():
    results = [_timed(0, 5.0, 10.0), RequestResult(1, ok=False, error="UNAVAILABLE: gone")]
    ttft, token2 = breakdowns(results)
    assert ttft["client_hop"]["median"] == 0.0 and token2 is None


def test_no_timings_is_none_in_the_json_and_na_in_the_table():
    """The OpenAI backend gets no per-request timings: nothing is made up."""
    results = [RequestResult(0, ok=True, output_len=3, ttft_s=0.01, e2e_s=0.05)]
    summary = summarize(results, 1.0)
    assert summary["ttft_breakdown"] is None and summary["token2_breakdown"] is None
    assert per_request(results)[0]["timings_ms"] is None
    out = io.StringIO()
    print_summary(out, summary, BenchConfig(address="x:1"), "m")
    text = out.getvalue()
    assert text.count("n/a (no per-request timings") == 2, text


def test_the_table_lists_every_part():
    summary = summarize([_timed(i, 20.0, 10.0, gap=8.0) for i in range(5)], 1.0)
    out = io.StringIO()
    print_summary(out, summary, BenchConfig(address="x:1"), "m")
    text = out.getvalue()
    assert "TTFT Breakdown (ms)" in text and "Second Token Gap Breakdown (ms)" in text
    for part in ("router_queue", "first_token_delivery", "client_hop", "handover", "reserve_wait"):
        assert part in text, part
