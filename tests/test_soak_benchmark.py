"""benchmarks/soak.py end to end at a small size, in CI: real router and worker processes, client
cancellations, Abort RPCs, bursts, and a decode worker, a prefill worker and the router each
SIGKILLed and restarted on their ports; the soak's own verdict (nothing lost, nothing duplicated,
no KV block or lease left) must hold, and its report must add up. On failure the soak prints
the tail of every service's log, which lands in the assertion message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


@pytest.mark.slow
def test_small_soak_loses_nothing_and_leaks_nothing(tmp_path, tiny_llama):
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            str(SOAK),
            "--model-dir",
            str(tiny_llama),
            "--requests",
            "80",
            "--concurrency",
            "4",
            "--cancel-share",
            "0.15",
            "--abort-share",
            "0.1",
            "--bursts",
            "1",
            "--kills",
            "3",
            "--max-tokens",
            "12",
            "--log-dir",
            str(tmp_path / "logs"),
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=540,  # under pytest's own 600 s, so a hung soak still shows its output below
    )
    # the whole output: on failure the soak ends it with every service's log tail
    assert run.returncode == 0, run.stdout[-60000:] + run.stderr[-5000:]
    got = json.loads(out.read_text())
    assert got["lost"] == 0 and got["duplicated"] == 0
    ended = got["succeeded"] + got["cancelled"] + sum(got["failed_by_status"].values())
    assert ended == got["requests"] == 80
    assert got["succeeded"] > 0 and got["cancelled"] > 0
    assert got["aborted"] > 0 and got["bursts"] == 1  # the Abort RPCs landed, the burst ran
    # only a kill may fail requests, and only as UNAVAILABLE (the stream's worker or the router died)
    assert set(got["failed_by_status"]) <= {"UNAVAILABLE"}
    assert [k["worker"] for k in got["kills"]] == ["decode-worker-0", "prefill-worker-0", "router"]
    for kill in got["kills"]:
        assert kill["detect_s"] < 5 and kill["recover_s"] < 120, kill
    assert all(
        v == {"leaked_blocks": 0, "leases": 0, "running": 0} for v in got["kv_at_end"].values()
    )
