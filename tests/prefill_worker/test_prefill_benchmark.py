"""benchmarks/prefill.py runs on CPU (tiny preset, short prompts) and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill.py"


def _load():
    spec = importlib.util.spec_from_file_location("prefill_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_help_and_cpu_smoke_run(tiny_llama, tmp_path, capsys):
    pytest.importorskip("transformers")
    bench = _load()
    with pytest.raises(SystemExit) as done:
        bench.parse_args(["--help"])
    assert done.value.code == 0 and "MFU" in capsys.readouterr().out
    out = tmp_path / "prefill.json"
    assert (
        bench.main(
            [
                "--preset",
                "tiny",
                "--model-dir",
                str(tiny_llama),
                "--device",
                "cpu",
                "--lengths",
                "24",
                "--mixed",
                "5,19",
                "--iters",
                "1",
                "--warmup",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert [c["case"] for c in result["cases"]] == ["24", "mixed"]
    for case in result["cases"]:
        for impl in ("runner", "engine", "transformers"):
            assert case[impl]["tokens_per_s"] > 0 and case[impl]["mfu"] > 0
        assert case["runner_vs_transformers"] > 0


def test_benchmark_writes_the_fast_table_and_the_first_prompt_ratio(tiny_llama, tmp_path):
    pytest.importorskip("transformers")
    fast = tmp_path / "prefill_fast.json"
    argv = ["--preset", "tiny", "--model-dir", str(tiny_llama), "--device", "cpu"]
    argv += ["--lengths", "24", "--mixed", "", "--iters", "1", "--warmup", "0"]
    argv += ["--fast-out", str(fast), "--fast-cases", "1x8,2x8", "--first-prompt-len", "16"]
    assert _load().main([*argv, "--out", str(tmp_path / "prefill.json")]) == 0
    result = json.loads(fast.read_text())
    assert [r["case"] for r in result["results"]] == ["1x8", "2x8"]
    for row in result["results"]:
        assert row["ms"] > 0 and row["mfu"] > 0 and row["ratio_to_transformers"] > 0
        assert row["sampled_ms"] > 0
    assert result["first_prompt_ratio"] > 0 and result["startup_s"] > 0
    # the first probe's worker rehearsed (forced on, even on CPU) and said so; the A/B's did not
    assert result["rehearsal"] is True
    requests, ms = result["rehearsal_requests_ms"]
    assert requests == 2 and ms > 0  # max_model_len 32: buckets 30 and 16
    assert result["no_rehearsal"]["first_prompt_ratio"] > 0
    assert result["serving_compilations"] == 0  # CPU: nothing compiles; the metric is scraped
    for key in ("step_ms_first_then_rest", "step_thread_ms_first_then_rest"):
        first, rest = result[key]
        assert first > 0 and rest > 0, (key, result[key])
    # the step thread's time is part of the loop's step time
    assert result["step_thread_ms_first_then_rest"][0] <= result["step_ms_first_then_rest"][0]
