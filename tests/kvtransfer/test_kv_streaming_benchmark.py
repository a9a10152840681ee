"""benchmarks/kv_streaming.py runs on CPU (tiny model, TCP loopback) and merges its
`exposed_ms` rows into an existing kv_handover.json, leaving the other keys alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_streaming.py"


def test_cpu_smoke_run_writes_exposed_rows(tiny_llama, tmp_path):
    out = tmp_path / "kv_handover.json"
    sizes = [{"mib": 1, "path_ms": 1.0, "raw_ms": 0.5, "ratio": 0.5}]
    out.write_text(json.dumps({"sizes": sizes}))  # what the transfer benchmark wrote
    args = ["--preset", "tiny", "--model-dir", str(tiny_llama), "--device", "cpu"]
    args += ["--prompt-tokens", "24,70", "--block-size", "4", "--iters", "1", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["sizes"] == sizes
    rows = data["exposed_ms"]
    assert [(r["prompt_tokens"], r["streaming"]) for r in rows] == [
        (24, True),
        (24, False),
        (70, True),
        (70, False),
    ]
    assert all(isinstance(r["ms"], float) and r["ms"] > 0 for r in rows), rows


def test_timeline_times_every_piece_on_both_sides(tiny_llama, tmp_path):
    # kv_streaming_timeline.py wraps the sender and receiver: each streamed run's pieces appear
    # on both sides (taken, gathered, sent; header, landed), and the prompt's end
    out, timeline = tmp_path / "kv.json", tmp_path / "t.jsonl"
    args = ["--preset", "tiny", "--model-dir", str(tiny_llama), "--device", "cpu"]
    args += ["--prompt-tokens", "40", "--block-size", "4", "--iters", "1", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("kv_streaming_timeline.py")), *args, "--timeline", str(timeline)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    labels = {(e["role"], e["label"]) for e in events}
    want = {("P", "piece"), ("P", "ready"), ("P", "sent"), ("P", "finished"), ("P", "group")}
    assert want | {("D", "head"), ("D", "landed"), ("B", "case"), ("B", "end")} <= labels, labels
    streamed = [line for line in done.stdout.splitlines() if line.startswith("40-s-")]
    assert len(streamed) == 2 and all("D landed" in line for line in streamed), done.stdout
