"""The benchmark's numbers from its per-request results (numpy percentiles).

    summarize(results, duration_s, slo) -> dict      throughputs, latency stats, goodput
    latency_samples(results) -> {metric: [ms, ...]}  what the stats and the plot are made of

Latency stats are in milliseconds: mean, median, p90, p99 (None when no sample exists).
Goodput (vLLM's definition): completed requests per second that met every SLO given
(`--slo ttft:MS,tpot:MS,itl:MS,e2el:MS`; itl: every gap of the request). TTFT and the second
token's gap split into their parts: ttft_breakdown.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from splitserve.cli.bench.runner import RequestResult
from splitserve.cli.bench.ttft_breakdown import breakdowns

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)


def latency_samples(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.ok]
    return {
        "ttft": [r.ttft_s * 1e3 for r in ok],
        "tpot": [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None],
        "itl": [x * 1e3 for r in ok for x in r.itls_s],
        "e2el": [r.e2e_s * 1e3 for r in ok],
    }


def stats(samples: Sequence[float]) -> dict[str, float | None]:
    if not len(samples):
        return {"mean": None, "median": None, "p90": None, "p99": None}
    a = np.asarray(samples, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, PERCENTILES)
    return {"mean": float(a.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    got = {"ttft": r.ttft_s, "tpot": r.tpot_s, "itl": max(r.itls_s, default=None), "e2el": r.e2e_s}
    for key, limit_ms in slo.items():
        value = got[key]
        if value is not None and value * 1e3 > limit_ms:
            return False
    return True


def summarize(
    results: Sequence[RequestResult], duration_s: float, slo: dict[str, float] | None = None
) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kind = (r.error or "error").split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + 1
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    duration_s = max(duration_s, 1e-9)
    samples = latency_samples(results)
    ttft_parts, token2_parts = breakdowns(results)
    out = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        **{f"{m}_ms": stats(samples[m]) for m in METRICS},
        "ttft_breakdown": ttft_parts,  # None without per-request timings (the OpenAI backend)
        "token2_breakdown": token2_parts,
        "slo_ms": dict(slo or {}),
        "goodput": None,
        "good_requests": None,
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in results)
        out["good_requests"] = good
        out["goodput"] = good / duration_s
    return out


def per_request(results: Sequence[RequestResult]) -> list[dict]:
    """The raw rows of the JSON output."""
    return [
        {
            "index": r.index,
            "ok": r.ok,
            "error": r.error,
            "input_len": r.input_len,
            "output_len": r.output_len,
            "start_s": r.start_s,
            "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1e3,
            "tpot_ms": None if r.tpot_s is None else r.tpot_s * 1e3,
            "e2el_ms": r.e2e_s * 1e3,
            "itls_ms": [x * 1e3 for x in r.itls_s],
            "timings_ms": r.timings,
            **({"kind": r.kind} if r.kind else {}),
            **({"output_token_ids": r.token_ids} if r.token_ids is not None else {}),
            **({"output_text": r.text} if r.text is not None else {}),
        }
        for r in results
    ]
