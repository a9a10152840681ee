"""benchmarks/kvtransfer.py on the CPU: a real run (two processes, UCX) writes the issue-32
"sizes" rows into its --out file and keeps the keys another benchmark put there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kvtransfer.py"


def test_sizes_rows_are_merged_into_the_output(tmp_path):
    out = tmp_path / "kv_handover.json"
    out.write_text(json.dumps({"exposed_ms": [{"prompt_tokens": 1024, "streaming": True}]}))
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes-mib", "1,2", "--no-prompts", "--iters", "1"]
        + ["--checksum", "always", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["exposed_ms"] == [{"prompt_tokens": 1024, "streaming": True}]
    assert [row["mib"] for row in data["sizes"]] == [1, 2]
    for row in data["sizes"]:
        assert set(row) == {"mib", "path_ms", "raw_ms", "ratio"}
        assert row["path_ms"] > 0 and row["raw_ms"] > 0
        assert abs(row["ratio"] - row["raw_ms"] / row["path_ms"]) < 1e-3
    assert data["device"] == "cpu" and "--checksum always" in data["kvtransfer_command"]
