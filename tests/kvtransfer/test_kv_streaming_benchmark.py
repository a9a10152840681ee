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
