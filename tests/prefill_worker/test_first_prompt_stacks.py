"""benchmarks/prefill_first_prompt_stacks.py runs a real prefill worker under its stack sampler
and reports each prompt and the busy stacks of the first beside the third."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_first_prompt_stacks.py"


def test_the_stack_probe_reports_each_prompt_and_the_step_threads_stacks(tiny_llama):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--model-dir", str(tiny_llama), "--device", "cpu"]
        + ["--length", "96", "--prompts", "3", "--top", "50"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(re.findall(r"^prompt \d: [\d.]+ ms", out.stdout, re.M)) == 3
    samples = re.search(r"busy stack samples: first prompt (\d+) of (\d+)", out.stdout)
    assert samples and int(samples[2]) > 0, out.stdout
