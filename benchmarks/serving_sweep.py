"""The goodput curve's arithmetic for serving_compare.py: no processes, no I/O.

    point_metrics(summary, sent)        one bench run -> the figures the sweep compares
    aggregate(points)                   per (mode, rate): the median over repeats, min/max spread
    sustainable_rate(sweep, mode)       highest swept rate with median SLO attainment >= 90 %
    next_rate(sweep, max_rate)          the rate past the list, or None when both modes fell
    rows_at(sweep, rate)                today's comparison rows at one rate
    goals(sweep, sustainable)           issue 33's PASS/FAIL checks
    merge_points(old, new)              --resume: new points replace old ones of the same key
    build_doc(...)                      the JSON document

SLO attainment is requests within the SLO / requests sent (a failed request is a miss); goodput is
bench's (requests within the SLO per second of the run, the drain included). The sustainable rate
is the highest rate actually swept whose median attainment is >= 90 % (no extrapolation between
rates); 0.0 when no swept rate holds.
"""

from __future__ import annotations

import statistics

TARGET = 0.9
MODES = ("disaggregated", "colocated")
# point_metrics' keys: what the sweep aggregates (median + spread) per mode and rate
FIGURES = (
    "goodput",
    "slo_attainment",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "request_throughput",
    "output_throughput",
)
BREAKDOWNS = ("ttft_breakdown", "token2_breakdown")  # bench --json-out, when it has them
# today's rows: metric -> (summary figure); ratio = colocated / disaggregated
ROWS = {
    "ttft_ms_median": "ttft_p50_ms",
    "ttft_ms_p99": "ttft_p99_ms",
    "itl_ms_median": "itl_p50_ms",
    "itl_ms_p99": "itl_p99_ms",
    "tpot_ms_median": "tpot_p50_ms",
    "tpot_ms_p99": "tpot_p99_ms",
    "goodput": "goodput",
    "request_throughput": "request_throughput",
    "output_throughput": "output_throughput",
}


def point_metrics(summary: dict, sent: int) -> dict:
    """bench's --json-out summary of one run of `sent` requests -> the sweep's figures."""

    def stat(key: str, s: str) -> float | None:
        return (summary.get(key) or {}).get(s)

    good = summary.get("good_requests") or 0
    out = {
        "goodput": summary.get("goodput") or 0.0,
        "slo_attainment": good / sent if sent else 0.0,
        "ttft_p50_ms": stat("ttft_ms", "median"),
        "ttft_p99_ms": stat("ttft_ms", "p99"),
        "itl_p50_ms": stat("itl_ms", "median"),
        "itl_p99_ms": stat("itl_ms", "p99"),
        "tpot_p50_ms": stat("tpot_ms", "median"),
        "tpot_p99_ms": stat("tpot_ms", "p99"),
        "request_throughput": summary.get("request_throughput") or 0.0,
        "output_throughput": summary.get("output_throughput") or 0.0,
        "failed": summary.get("failed", 0),
    }
    for key in BREAKDOWNS:
        if isinstance(summary.get(key), dict):
            out[key] = summary[key]
    return out


def _median_breakdown(parts: list[dict]) -> dict:
    """component -> {stat: median over repeats} for the components every repeat has."""
    common = set.intersection(*(set(p) for p in parts))
    return {
        c: {
            s: statistics.median(p[c][s] for p in parts)
            for s in parts[0][c]
            if all(p[c].get(s) is not None for p in parts)
        }
        for c in sorted(common)
    }


def aggregate(points: list[dict]) -> list[dict]:
    """One entry per (mode, rate), sorted by rate then mode: each figure's median over the
    repeats, `spread` {figure: {min, max}}, `repeats`."""
    groups: dict[tuple[float, str], list[dict]] = {}
    for p in points:
        groups.setdefault((float(p["rate"]), p["mode"]), []).append(p["metrics"])
    sweep = []
    for (rate, mode), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        entry: dict = {"rate": rate, "mode": mode, "repeats": len(runs), "spread": {}}
        for f in FIGURES:
            values = [r[f] for r in runs if r.get(f) is not None]
            entry[f] = float(statistics.median(values)) if values else None
            if values:
                entry["spread"][f] = {"min": float(min(values)), "max": float(max(values))}
        entry["failed"] = sum(r.get("failed", 0) for r in runs)
        for key in BREAKDOWNS:
            parts = [r[key] for r in runs if key in r]
            if parts and len(parts) == len(runs):
                entry[key] = _median_breakdown(parts)
        sweep.append(entry)
    return sweep


def _entries(sweep: list[dict], mode: str) -> dict[float, dict]:
    return {e["rate"]: e for e in sweep if e["mode"] == mode}


def sustainable_rate(sweep: list[dict], mode: str) -> float:
    held = [r for r, e in _entries(sweep, mode).items() if e["slo_attainment"] >= TARGET]
    return max(held, default=0.0)


def next_rate(sweep: list[dict], max_rate: float) -> float | None:
    """Double the highest rate swept while either mode still holds the SLO there (>= 90 %);
    None when both fell under it, or doubling would pass max_rate."""
    rates = sorted({e["rate"] for e in sweep})
    if not rates:
        return None
    top = rates[-1]
    holding = [
        e
        for e in sweep
        if e["rate"] == top and e["slo_attainment"] is not None and e["slo_attainment"] >= TARGET
    ]
    if not holding or top * 2 > max_rate:
        return None
    return top * 2


def rows_at(sweep: list[dict], rate: float) -> dict:
    dis, col = _entries(sweep, "disaggregated").get(rate), _entries(sweep, "colocated").get(rate)
    rows = {}
    for name, figure in ROWS.items():
        a = dis.get(figure) if dis else None
        b = col.get(figure) if col else None
        rows[name] = {
            "disaggregated": a,
            "colocated": b,
            "ratio": b / a if a and b is not None else None,
        }
    return rows


def rows_rate(sweep: list[dict], sustainable: dict[str, float]) -> float | None:
    """The rate of the rows: colocated's sustainable rate, else the lowest rate both modes ran."""
    both = sorted(set(_entries(sweep, "disaggregated")) & set(_entries(sweep, "colocated")))
    if sustainable.get("colocated") in both:
        return sustainable["colocated"]
    return both[0] if both else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


LOW_LOAD_RATE = 1.0  # issue 33: the hand-over's overhead where nothing queues


def goals(sweep: list[dict], sustainable: dict[str, float]) -> list[dict]:
    """Issue 33's goals: name, pass, detail (the figures behind the verdict)."""
    dis, col = _entries(sweep, "disaggregated"), _entries(sweep, "colocated")
    s_dis, s_col = sustainable["disaggregated"], sustainable["colocated"]
    out = [
        {
            "name": "disaggregated sustainable rate >= 2x colocated's",
            "pass": s_col > 0 and s_dis >= 2 * s_col,
            "detail": f"{s_dis:g} vs {s_col:g} req/s",
        }
    ]
    at_d, at_c = dis.get(s_col, {}), col.get(s_col, {})
    itl = _ratio(at_c.get("itl_p99_ms"), at_d.get("itl_p99_ms"))  # colocated / disaggregated
    ttft = _ratio(at_d.get("ttft_p99_ms"), at_c.get("ttft_p99_ms"))  # disaggregated / colocated
    where = f"at {s_col:g} req/s" if s_col > 0 else "at colocated's sustainable rate"
    missing = "no figures: colocated holds the SLO at no rate that both modes ran"
    out.append(
        {
            "name": f"{where} ITL p99 >= 3x better",
            "pass": itl is not None and itl >= 3,
            "detail": missing if itl is None else f"colocated / disaggregated = {itl:.2f}x",
        }
    )
    out.append(
        {
            "name": f"{where} TTFT p99 <= 1.5x colocated's",
            "pass": ttft is not None and ttft <= 1.5,
            "detail": missing if ttft is None else f"disaggregated / colocated = {ttft:.2f}x",
        }
    )
    checked = [
        (r, x)
        for r in sorted(set(dis) & set(col))
        if r <= s_col and (x := _ratio(dis[r]["ttft_p99_ms"], col[r]["ttft_p99_ms"])) is not None
    ]
    bad = [f"{r:g}: {x:.2f}x" for r, x in checked if x > 1.5]
    out.append(
        {
            "name": "at every rate up to colocated's sustainable one, disaggregated TTFT p99 <= 1.5x",
            "pass": bool(checked) and not bad,
            "detail": ", ".join(bad) if bad else f"{len(checked)} rate(s) checked",
        }
    )
    low_d, low_c = dis.get(LOW_LOAD_RATE, {}), col.get(LOW_LOAD_RATE, {})
    if low_d.get("ttft_p50_ms") is not None and low_c.get("ttft_p50_ms") is not None:
        # only in a sweep that ran 1 req/s (docs/serving_compare.md: 128-token prompts)
        extra = low_d["ttft_p50_ms"] - low_c["ttft_p50_ms"]
        out.append(
            {
                "name": f"at {LOW_LOAD_RATE:g} req/s disaggregated TTFT p50 <= colocated + 2 ms",
                "pass": extra <= 2.0,
                "detail": f"{low_d['ttft_p50_ms']:.2f} vs {low_c['ttft_p50_ms']:.2f} ms",
            }
        )
    return out


def point_key(p: dict) -> tuple[str, float, int]:
    return p["mode"], float(p["rate"]), int(p["repeat"])


def merge_points(old: list[dict], new: list[dict]) -> list[dict]:
    merged = {point_key(p): p for p in old}
    merged.update({point_key(p): p for p in new})
    return sorted(merged.values(), key=lambda p: (p["rate"], p["repeat"], p["mode"]))


def build_doc(config: dict, gpus: int, placement: dict, warmup: dict, points: list[dict]) -> dict:
    sweep = aggregate(points)
    sustainable = {m: float(sustainable_rate(sweep, m)) for m in MODES}
    at = rows_rate(sweep, sustainable)
    return {
        "gpus": gpus,
        "sustainable_rate": sustainable,
        "rows_rate": at,
        "rows": rows_at(sweep, at) if at is not None else {},
        "sweep": sweep,
        "goals": goals(sweep, sustainable),
        "slo_target": TARGET,
        "config": config,
        "placement": placement,
        "warmup": warmup,
        "points": points,
    }
