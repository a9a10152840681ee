"""TTFT and the second token's gap split into their parts, from each request's own timings.

The router sends every request's timings on its last chunk (GenerateResponse.timings,
router/request_timings.py); the gRPC runner keeps them per request (`timings_ms`), and these
figures come from those per-request numbers, never from histogram buckets. The OpenAI backend
gets no timings: its breakdowns are None (n/a in the table).

    ttft_breakdown    router_queue, prefill_queue, prefill_compute (prefill_sampling is part of
                      it), first_token_delivery, client_hop (the client's TTFT beyond the
                      router's: its hop to the router and back, its own handling)
    token2_breakdown  second_token_gap (the router's gap between the first and the second
                      token's chunks) and its parts handover, first_decode_step,
                      second_token_delivery; beside them reserve_wait (the decode worker's
                      wait for room in its block pool on a streamed hand-over: backpressure;
                      not a term of the sum, it overlaps the prefill)

Each part: its own median and p99 over the requests, and `at_p99`: its mean over the requests
whose TTFT (client's) or gap is at or above that total's p99, so the parts of a p99 spike add
up to about the spike (a part's own p99 may come from other requests).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from splitserve.protos import generate_pb2

TTFT_PARTS = (
    "router_queue",
    "prefill_queue",
    "prefill_compute",
    "prefill_sampling",
    "first_token_delivery",
    "client_hop",
)
# summed to the router's TTFT (prefill_sampling is inside prefill_compute)
ROUTER_TTFT_SUM = ("router_queue", "prefill_queue", "prefill_compute", "first_token_delivery")
TOKEN2_PARTS = (
    "second_token_gap",
    "handover",
    "first_decode_step",
    "second_token_delivery",
    "reserve_wait",
)


def timings_ms(msg: generate_pb2.RequestTimings) -> dict[str, float]:
    """One request's timings as the JSON request record keeps them (ms; the gap's parts only
    when a second token came)."""
    out = {
        "router_queue": msg.router_queue_ms,
        "prefill_queue": msg.prefill_queue_ms,
        "prefill_compute": msg.prefill_compute_ms,
        "prefill_sampling": msg.prefill_sampling_ms,
        "first_token_delivery": msg.first_token_delivery_ms,
    }
    if msg.HasField("second_token_gap_ms"):
        out["second_token_gap"] = msg.second_token_gap_ms
        out["handover"] = msg.handover_ms
        out["first_decode_step"] = msg.first_decode_step_ms
        out["second_token_delivery"] = msg.second_token_delivery_ms
        out["reserve_wait"] = msg.reserve_wait_ms
    return out


def with_client_hop(timings: dict[str, float], client_ttft_ms: float) -> dict[str, float]:
    """`timings` plus client_hop: the client's TTFT minus the router's (durations of two
    clocks compared, never their timestamps), at least 0."""
    router_ttft = sum(timings[k] for k in ROUTER_TTFT_SUM)
    return {**timings, "client_hop": max(0.0, client_ttft_ms - router_ttft)}


def _parts(rows: Sequence[dict[str, float]], totals: Sequence[float], parts) -> dict | None:
    if not rows:
        return None
    cut = float(np.percentile(np.asarray(totals, dtype=np.float64), 99))
    tail = [row for row, total in zip(rows, totals) if total >= cut]
    out = {}
    for part in parts:
        values = np.asarray([row[part] for row in rows], dtype=np.float64)
        out[part] = {
            "median": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99)),
            "at_p99": float(np.mean([row[part] for row in tail])),
        }
    return out


def breakdowns(results) -> tuple[dict | None, dict | None]:
    """(ttft_breakdown, token2_breakdown) of the successful requests that carry timings."""
    ttft_rows, ttft_totals, gap_rows = [], [], []
    for r in results:
        if not r.ok or r.timings is None or r.ttft_s is None:
            continue
        ttft_rows.append(with_client_hop(r.timings, r.ttft_s * 1e3))
        ttft_totals.append(r.ttft_s * 1e3)
        if "second_token_gap" in r.timings:
            gap_rows.append(r.timings)
    return (
        _parts(ttft_rows, ttft_totals, TTFT_PARTS),
        _parts(gap_rows, [row["second_token_gap"] for row in gap_rows], TOKEN2_PARTS),
    )
