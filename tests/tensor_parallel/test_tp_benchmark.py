"""benchmarks/decode_tp.py on CPU (gloo, eager steps, tiny shapes): the script runs end to end for
two presets at TP 1 and 2, writes step times per batch size, and its greedy check finds TP2's
tokens equal to TP1's. Also: the larger Llama shape preset is the real Llama 3.1 8B geometry."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from splitserve.cli.presets import PRESETS
from splitserve.config.engine_config import RopeScaling

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_tp.py"


def test_decode_tp_smoke_on_cpu(tmp_path):
    out = tmp_path / "decode_tp.json"
    t0 = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-dir",
            str(tmp_path / "models"),
            "--presets",
            "tiny,tiny-qwen2",
            "--device",
            "cpu",
            "--tp-sizes",
            "1,2",
            "--batch-sizes",
            "1,2",
            "--context",
            "16",
            "--steps",
            "4",
            "--block-size",
            "4",
            "--check-prompts",
            "3",
            "--check-tokens",
            "8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert time.monotonic() - t0 < 60
    result = json.loads(out.read_text())
    assert result["tp_sizes"] == [1, 2] and set(result["presets"]) == {"tiny", "tiny-qwen2"}
    for preset in result["presets"].values():
        assert [r["batch"] for r in preset["results"]] == [1, 2]
        assert all(
            r["tp1_step_ms"] > 0 and r["tp2_step_ms"] > 0 and r["tp2_speedup"] > 0
            for r in preset["results"]
        )
        assert preset["greedy_check"]["tp2"] == {"greedy_match": True, "first_mismatch": None}
    assert "tp2 greedy tokens vs tp1: match" in run.stderr


def test_first_mismatch_names_where_tokens_diverge():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from decode_tp import first_mismatch
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert first_mismatch([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) is None
    assert first_mismatch([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == {
        "prompt": 1,
        "position": 1,
        "tp1_token": 5,
        "token": 6,
    }
    assert first_mismatch([[1, 2, 3]], [[1, 2]])["position"] == 2


def test_llama_31_8b_preset_has_the_real_geometry():
    c = PRESETS["llama-3.1-8b"]
    assert (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
        c["vocab_size"],
    ) == (4096, 14336, 32, 32, 8, 128, 128256)
    assert c["rope_theta"] == 500000.0 and not c["tie_word_embeddings"]
    assert RopeScaling(**c["rope_scaling"]) == RopeScaling(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
