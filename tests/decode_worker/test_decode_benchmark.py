"""benchmarks/decode.py's --sampling and --constrained runs on CPU (tiny preset, a few steps):
the scripts run end to end and write issue 30's / issue 35's JSON rows (the figures mean
nothing on CPU; the H200 results are under benchmarks/results/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode.py"
MODES = {"greedy", "temp_top_p", "seeded_top_k", "penalties", "logprobs5", "mixed"}


def _run(tiny_llama, out: Path, *extra: str) -> dict:
    args = [sys.executable, str(SCRIPT), "--model-dir", str(tiny_llama), "--preset", "tiny"]
    args += ["--device", "cpu", "--steps", "2", "--context", "16", "--out", str(out), *extra]
    run = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_sampling_modes_against_greedy_on_cpu(tiny_llama, tmp_path):
    found = _run(
        tiny_llama, tmp_path / "s.json", "--sampling", "all", "--batch-sizes", "4", "--repeats", "2"
    )
    rows = found["results"]
    assert {r["mode"] for r in rows} == MODES and {r["batch"] for r in rows} == {4}
    greedy = next(r["engine_step_ms"] for r in rows if r["mode"] == "greedy")
    for r in rows:
        assert set(r) == {"batch", "mode", "engine_step_ms", "ratio_to_greedy"}
        assert r["engine_step_ms"] > 0
        assert abs(r["ratio_to_greedy"] - r["engine_step_ms"] / greedy) < 1e-9
    assert found["repeats"] == 2


def test_constrained_half_batch_on_cpu(tiny_llama, tmp_path):
    found = _run(tiny_llama, tmp_path / "c.json", "--constrained", "--batch-sizes", "2")
    (row,) = found["results"]
    assert row["batch"] == 2 and row["ratio_to_unconstrained"] > 0
    assert found["first_token_ms_new_schema"] > 0 and found["first_token_ms_cached_schema"] > 0
    # the A/B of reading rows beside the mask fill or on the engine thread, and the host phases
    assert row["ab_beside_ratio"] > 0 and row["ab_inline_ratio"] > 0
    phases = found["host_phases_ms_per_step"]
    assert phases["batch"] == 2 and phases["step"] > 0 and phases["mask_fill_incl_rows_beside"] > 0
