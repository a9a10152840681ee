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
