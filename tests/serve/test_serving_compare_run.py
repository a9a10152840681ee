"""benchmarks/serving_compare.py end to end on CPU (tiny model, the synthetic mixed workload at two
low rates, one repeat): it starts a real `serve` per mode, warms each up, writes the JSON shape of
issue 33 (and the PNG when matplotlib is installed); a second command resumes the file, skips the
points it has, runs one mode only and goes past its rates while that mode still holds the SLO;
a third adds a repeat of that mode, over its own rates and those the file went on to.
Every point ends with every worker's KV blocks free and no lease held (the script checks each
point through GetLoad and fails otherwise; the JSON records it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving_compare.py"
TINY = [
    "--device", "cpu", "--workload", "mixed", "--repeats", "1",
    "--min-prompts", "6", "--point-seconds", "1", "--warmup-prompts", "2", "--warmup-rate", "8",
    "--long-share", "0.3", "--long-len", "24", "--short-len", "8", "--long-output", "2",
    "--short-output", "6", "--num-blocks", "128", "--max-model-len", "256",
    "--serve-args", "--block-size 4", "--slo", "ttft:60000,tpot:60000",
]  # fmt: skip


def _run(tiny_llama, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model-dir", str(tiny_llama), *TINY, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
def test_sweep_json_shape_then_resume_and_extend(tiny_llama, tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    plot = ["--plot", str(png)] if _has_matplotlib() else []
    first = _run(tiny_llama, "--rates", "2,4", "--no-extend", "--out", str(out), *plot)
    doc = json.loads(out.read_text())

    assert isinstance(doc["gpus"], int) and doc["gpus"] == 1
    assert set(doc["sustainable_rate"]) == {"disaggregated", "colocated"}
    assert all(isinstance(v, float) for v in doc["sustainable_rate"].values())
    assert doc["sustainable_rate"] == {"disaggregated": 4.0, "colocated": 4.0}  # generous SLO
    assert doc["rows_rate"] == 4.0
    for name in ("ttft_ms_p99", "itl_ms_p99", "tpot_ms_median", "goodput"):
        row = doc["rows"][name]
        assert set(row) == {"disaggregated", "colocated", "ratio"}, name
        assert row["disaggregated"] > 0 and row["colocated"] > 0
        assert row["ratio"] == pytest.approx(row["colocated"] / row["disaggregated"])
    assert {(e["rate"], e["mode"]) for e in doc["sweep"]} == {
        (r, m) for r in (2.0, 4.0) for m in ("disaggregated", "colocated")
    }
    for e in doc["sweep"]:
        assert isinstance(e["rate"], float) and isinstance(e["mode"], str)
        for key in ("goodput", "slo_attainment", "ttft_p99_ms", "itl_p99_ms"):
            assert isinstance(e[key], float), (key, e)
            assert e["spread"][key]["min"] <= e[key] <= e["spread"][key]["max"]
        assert e["slo_attainment"] == 1.0 and e["repeats"] == 1 and e["failed"] == 0
    assert len(doc["goals"]) == 4 and all(isinstance(g["pass"], bool) for g in doc["goals"])
    assert sum(line.startswith(("PASS", "FAIL")) for line in first.stdout.splitlines()) == 4

    # the same GPUs, the same arrivals: one seed per point for both modes, warm-ups recorded
    assert doc["placement"]["disaggregated"]["devices"] == doc["placement"]["colocated"]["devices"]
    assert set(doc["warmup"]) == {"disaggregated", "colocated"}
    assert all(w["prompts"] == 2 and all(w["kv_free"].values()) for w in doc["warmup"].values())
    points = {(p["mode"], p["rate"]): p for p in doc["points"]}
    assert len(points) == 4
    for rate in (2.0, 4.0):
        dis, col = points["disaggregated", rate], points["colocated", rate]
        assert dis["seed"] == col["seed"] and dis["num_prompts"] == col["num_prompts"] == 6
        assert {dis["order"], col["order"]} == {0, 1}
        assert dis["summary"]["completed"] == col["summary"]["completed"] == 6
    assert points["disaggregated", 2.0]["order"] != points["disaggregated", 4.0]["order"]
    assert points["disaggregated", 2.0]["seed"] != points["disaggregated", 4.0]["seed"]
    assert set(points["disaggregated", 2.0]["kv_free"]) == {"prefill-0", "decode-0"}
    assert set(points["colocated", 2.0]["kv_free"]) == {"decode-0"}
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # resume: the four points stay, colocated alone goes past 4 req/s (it still holds the SLO)
    second = _run(
        tiny_llama, "--rates", "2,4", "--modes", "colocated", "--max-rate", "8",
        "--resume", str(out),
    )  # fmt: skip
    assert "[rate 2/s" not in second.stdout and "[rate 4/s" not in second.stdout
    assert "extending to 8" in second.stdout and "[rate 8/s repeat 0] colocated" in second.stdout
    assert "[disaggregated] starting serve" not in second.stdout
    again = json.loads(out.read_text())
    assert sorted((p["mode"], p["rate"]) for p in again["points"]) == sorted(
        [*points, ("colocated", 8.0)]
    )
    old = {(p["mode"], p["rate"]): p["wall_s"] for p in doc["points"]}
    assert all(old[p["mode"], p["rate"]] == p["wall_s"] for p in again["points"] if p["rate"] < 8)
    assert again["sustainable_rate"]["colocated"] == 8.0
    assert all(all(p["kv_free"].values()) for p in again["points"])

    # another repeat of colocated: its list, then the rates the file went on to (4 and 8)
    third = _run(
        tiny_llama, "--rates", "2", "--modes", "colocated", "--max-rate", "8",
        "--repeats", "2", "--repeat-index", "1", "--resume", str(out),
    )  # fmt: skip
    ran = [line.split("]")[0] for line in third.stdout.splitlines() if line.startswith("[rate")]
    assert ran == ["[rate 2/s repeat 1", "[rate 4/s repeat 1", "[rate 8/s repeat 1"], third.stdout
    last = json.loads(out.read_text())
    assert [e["repeats"] for e in last["sweep"] if e["mode"] == "colocated"] == [2, 2, 2]
    assert [e["repeats"] for e in last["sweep"] if e["mode"] == "disaggregated"] == [1, 1]
    assert all(all(p["kv_free"].values()) for p in last["points"])
