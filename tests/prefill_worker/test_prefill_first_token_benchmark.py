"""benchmarks/prefill_first_token.py runs on CPU (tiny model) and writes its rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_first_token.py"


def test_first_token_benchmark_cpu_smoke_run(tiny_llama, tmp_path):
    spec = importlib.util.spec_from_file_location("prefill_first_token", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "first_token.json"
    argv = ["--model-dir", str(tiny_llama), "--device", "cpu", "--lengths", "8,24"]
    assert bench.main([*argv, "--iters", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["all_blocks_free_at_end"]
    rows = result["results"]
    assert [r["prompt_tokens"] for r in rows] == [8, 24]
    for r in rows:
        for key in ("runner_ms", "sampler_greedy_ms", "sampler_sampled_ms"):
            assert r[key] > 0
        assert r["sampled_over_greedy"] == r["engine_sampled_ms"] / r["engine_greedy_ms"]
