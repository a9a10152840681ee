"""serving_compare.py's outputs besides the JSON it builds (serving_sweep.build_doc): a line per
point, the result table and goal verdicts at the end, and --resume's reading of an earlier file.

    say_point(point)             [rate R/s repeat K] MODE goodput, in SLO, TTFT / ITL p99
    say_result(doc)              sustainable rates, the rows at colocated's, PASS/FAIL per goal
    load_resume(path, config)    (points, warmup) of a file measured with the same RESUME_KEYS
"""

from __future__ import annotations

import json
from pathlib import Path

RESUME_KEYS = (
    "gpus",
    "pd_ratio",
    "device",
    "workload",
    "slo",
    "model_dir",
    "seed",
    "point_seconds",
    "min_prompts",
    "serve_args",
    "prefill_sm_share",
    "num_blocks",
    "max_model_len",
)


def load_resume(path: str, config: dict) -> tuple[list[dict], dict]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--resume {path}: cannot read it as JSON ({exc})") from None
    for key in RESUME_KEYS:
        if doc.get("config", {}).get(key) != config[key]:
            raise ValueError(
                f"--resume {path} was measured with {key}={doc['config'].get(key)!r}, this run has "
                f"{config[key]!r}: give the same flags, or a new --out"
            )
    return doc.get("points", []), doc.get("warmup", {})


def say_point(p: dict) -> None:
    m = p["metrics"]

    def ms(v):
        return "n/a" if v is None else f"{v:.1f} ms"

    print(
        f"[rate {p['rate']:g}/s repeat {p['repeat']}] {p['mode']:<13} goodput {m['goodput']:.2f}/s, "
        f"in SLO {m['slo_attainment']:.0%}, TTFT p99 {ms(m['ttft_p99_ms'])}, ITL p99 "
        f"{ms(m['itl_p99_ms'])} ({p['num_prompts']} req, {p['wall_s']:.1f}s)",
        flush=True,
    )


def say_result(doc: dict) -> None:
    s = doc["sustainable_rate"]
    print(f"sustainable rate (>= 90 % within SLO): disaggregated {s['disaggregated']:g} req/s, "
          f"colocated {s['colocated']:g} req/s")  # fmt: skip
    if doc["rows"]:
        print(f"at {doc['rows_rate']:g} req/s (median of repeats):")
        print(f"{'metric':20s} {'disaggregated':>14s} {'colocated':>10s} {'coloc/disagg':>13s}")
        for name, row in doc["rows"].items():
            a, b, r = row["disaggregated"], row["colocated"], row["ratio"]
            cells = ["n/a" if x is None else f"{x:.2f}" for x in (a, b)]
            ratio = "n/a" if r is None else f"{r:.2f}x"
            print(f"{name:20s} {cells[0]:>14s} {cells[1]:>10s} {ratio:>13s}")
    for g in doc["goals"]:
        print(f"{'PASS' if g['pass'] else 'FAIL'}  {g['name']}  ({g['detail']})")
