"""`benchmarks/sm_partition.py` (one GPU shared by prefill and decode: time-slicing, MPS,
green contexts): on CPU a smoke run of the two-process modes writes the JSON rows the GPU run
commits; the green-context partition arithmetic is checked here, its timing only on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_smoke_run_writes_rows(tmp_path, tiny_llama):
    out = tmp_path / "sm.json"
    cmd = [sys.executable, str(BENCH / "sm_partition.py"), "--model-dir", str(tiny_llama)]
    cmd += ["--device", "cpu", "--seconds", "0.3", "--modes", "alone,timeslice", "--batch", "2"]
    cmd += ["--context", "16", "--prompt-len", "32", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"alone", "timeslice"}
    for row in rows.values():
        for role in ("decode", "prefill"):
            stats = row[role]
            assert stats["iterations"] >= 1 and 0 < stats["p50_ms"] <= stats["p99_ms"]
    assert rows["timeslice"]["overlap"] > 0  # its size means something on a GPU only


def test_bad_shares_and_modes_are_one_line():
    for bad in (["--prefill-shares", "0"], ["--modes", "alone,fast"]):
        done = subprocess.run(
            [sys.executable, str(BENCH / "sm_partition.py"), *bad],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(
            "sm_partition.py: error:"
        )


def test_green_partition_sizes():
    from bench_import import bench_module

    partition = bench_module("sm_partition_green").partition

    assert partition(30, 132) == (40, 88)  # H200: 132 SMs
    assert partition(50, 132) == (64, 64)
    assert partition(1, 132) == (8, 120)
    with pytest.raises(ValueError, match="decode under"):
        partition(99, 16)
