"""The benchmark's outputs: a summary table on the terminal, a JSON file (--json-out)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TextIO

from splitserve.cli.bench.metrics import METRICS
from splitserve.cli.bench.workload import BenchConfig

NAMES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
WIDTH = 52


def _row(out: TextIO, label: str, value) -> None:
    if isinstance(value, float):
        value = f"{value:.2f}"
    out.write(f"{label:<40}{'n/a' if value is None else value:>12}\n")


def print_summary(out: TextIO, summary: dict, cfg: BenchConfig, model: str) -> None:
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    out.write("{s:{c}^{n}}\n".format(s=" Serving Benchmark Result ", n=WIDTH, c="="))
    _row(out, "Model:", model)
    _row(out, "Request rate (req/s):", rate)
    _row(out, "Max concurrency:", cfg.max_concurrency or "none")
    _row(out, "Successful requests:", summary["completed"])
    _row(out, "Failed requests:", summary["failed"])
    for kind, n in summary["errors"].items():
        _row(out, f"  {kind}:", n)
    _row(out, "Benchmark duration (s):", summary["duration_s"])
    _row(out, "Total input tokens:", summary["total_input_tokens"])
    _row(out, "Total generated tokens:", summary["total_output_tokens"])
    _row(out, "Request throughput (req/s):", summary["request_throughput"])
    if summary["goodput"] is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in summary["slo_ms"].items())
        _row(out, "Request goodput (req/s):", summary["goodput"])
        _row(
            out,
            f"  SLO {slo}:",
            f"{summary['good_requests']}/{summary['completed'] + summary['failed']}",
        )
    _row(out, "Output token throughput (tok/s):", summary["output_throughput"])
    _row(out, "Total token throughput (tok/s):", summary["total_token_throughput"])
    for m in METRICS:
        s = summary[f"{m}_ms"]
        out.write("{s:{c}^{n}}\n".format(s=f" {NAMES[m]} ", n=WIDTH, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            _row(out, f"{label} {m.upper()} (ms):", s[stat])
    _print_breakdown(out, " TTFT Breakdown (ms) ", summary.get("ttft_breakdown"))
    _print_breakdown(out, " Second Token Gap Breakdown (ms) ", summary.get("token2_breakdown"))
    out.write("=" * WIDTH + "\n")
    out.flush()


def _print_breakdown(out: TextIO, title: str, parts: dict | None) -> None:
    """One row per part: its median, its p99, its mean over the requests at the total's p99."""
    out.write("{s:{c}^{n}}\n".format(s=title, n=WIDTH, c="-"))
    if parts is None:
        out.write(f"{'n/a (no per-request timings: gRPC backend only)':<{WIDTH}}\n")
        return
    out.write(f"{'':<22}{'median':>10}{'p99':>10}{'at p99':>10}\n")
    for part, s in parts.items():
        out.write(f"{part:<22}{s['median']:>10.2f}{s['p99']:>10.2f}{s['at_p99']:>10.2f}\n")


def write_json(
    path: str | Path, summary: dict, cfg: BenchConfig, server: dict, requests: list[dict]
) -> None:
    config = cfg.model_dump()
    config["request_rate"] = (
        "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    )  # JSON has no inf
    backend = "splitserve" if cfg.backend == "grpc" else cfg.backend
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "backend": backend,
        "server": server,
        "config": config,
        **summary,
        "requests": requests,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
