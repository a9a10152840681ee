"""The grammar benchmarks run (CPU, the tiny tokenizer, a few steps): grammar_engines.py measures
the engines that import and says which it skipped (xgrammar and outlines-core live only in a
throw-away venv), and llguidance enforces every JSON Schema feature it lists; grammar_cpu.py
reports p50 / p90 per step in splitserve's own mask path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_grammar_engines_measures_what_imports_and_skips_the_rest(tiny_llama, tmp_path):
    eos = json.loads((tiny_llama / "config.json").read_text())["eos_token_id"]
    out = tmp_path / "engines.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "grammar_engines.py"),
        "--tokenizer",
        str(tiny_llama),
        "--eos",
        str(eos),
        "--steps",
        "4",
        "--schemas",
        "2",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    engines = json.loads(out.read_text())["engines"]
    assert set(engines) == {"llguidance", "xgrammar", "outlines_core"}
    ll = engines["llguidance"]
    assert "error" not in ll["compile"] and len(ll["compile"]["schemas"]) == 2
    assert ll["steps"]["batch"] == 64 and ll["steps"]["step_ms"]["p90"] > 0
    assert set(ll["features"]["summary"].values()) == {"supported"}, ll["features"]
    assert len(ll["features"]["summary"]) == 11
    for name, entry in engines.items():  # measured, or skipped saying why
        assert "skipped" in entry or "version" in entry, (name, entry)


def test_grammar_cpu_reports_the_step_percentiles(tiny_llama):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.grammar_cpu",
            "--model",
            str(tiny_llama),
            "--steps",
            "5",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    row = json.loads(done.stdout)
    assert row["batch"] == 64 and row["fill_threads"] >= 1
    assert 0 < row["step_ms"]["p50"] <= row["step_ms"]["p90"] <= row["step_ms"]["max"]
