"""Start and stop of a worker's ranks. Start-up fails at once, with one line, instead of hanging:
more ranks than visible GPUs are refused before anything is spawned, and a follower that exits
before joining the group makes rank 0 fail within seconds (not after the group's 30-minute
timeout). The follower watch reports a follower's death, but not the followers' exit at a clean
close."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import time

import pytest
import torch

from splitserve.config.engine_config import EngineConfig
from splitserve.engine.model_runner import PrefillChunk
from splitserve.engine.parallel import check_devices, destroy_tp
from splitserve.engine.tp_control import start_ranks

GPU_ERROR = r"parallel.tensor_parallel_size 2 with engine.device cuda(:0)? needs GPUs cuda:0..cuda:1, but 1 GPU"


def _cfg(folder, tp: int, device: str = "cpu") -> EngineConfig:
    return EngineConfig(
        model_path=str(folder),
        device=device,
        cache={"num_blocks": 32, "block_size": 8},
        parallel={"tensor_parallel_size": tp},
    )


def exit_at_once(rank: int, size: int, init_method: str, *args) -> None:
    """A follower that dies before joining (a failed import, a bad device, ...)."""
    sys.exit(3)


def test_more_ranks_than_gpus_is_refused_before_spawning(tiny_llama, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = set(mp.active_children())
    with pytest.raises(ValueError, match=GPU_ERROR):
        start_ranks(_cfg(tiny_llama, 2, "cuda"))
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size 1 with engine.device cuda:1 needs GPUs cuda:1..cuda:1",
    ):
        start_ranks(_cfg(tiny_llama, 1, "cuda:1"))
    assert set(mp.active_children()) == before  # nothing was spawned
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices(torch.device("cuda", 0), 2)  # fits: no error
    check_devices(torch.device("cpu"), 8)  # CPU ranks share the CPU


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="2 GPUs are visible here"
)
def test_worker_cli_names_both_fields_and_exits_at_once(tiny_llama):
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.cli.main",
            "prefill-worker",
            "--model",
            str(tiny_llama),
            "--device",
            "cuda",
            "--tensor-parallel-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "splitserve prefill-worker: error: parallel.tensor_parallel_size 2 with engine.device "
        "cuda needs GPUs cuda:0..cuda:1"
    ), out.stderr
    assert "tp1" not in out.stderr  # refused before any follower started
    print(f"refused in {time.monotonic() - t0:.1f}s")


def test_follower_exiting_before_joining_fails_rank0_quickly(tiny_llama):
    t0 = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"tensor-parallel rank 1 \(pid \d+\) exited with code 3 during start-up, "
        r"before joining the group",
    ):
        start_ranks(_cfg(tiny_llama, 2), exit_at_once)
    took = time.monotonic() - t0
    # a spawned interpreter's start (imports) on a loaded 2-core machine, not the group's timeout
    assert took < 60, took
    assert not [p for p in mp.active_children() if p.name.startswith("splitserve-tp-rank")]


def test_watch_reports_a_death_but_not_a_clean_close(tiny_llama):
    for kill in (False, True):
        deaths: list = []
        ranks = start_ranks(_cfg(tiny_llama, 2))
        ranks.watch(lambda rank, code, deaths=deaths: deaths.append((rank, code)))
        ranks.runner.prefill([PrefillChunk([1, 2, 3], 0, (1,))])  # a collective over both ranks
        if kill:
            ranks.procs[0].kill()
            # waits for the event; the bound only catches a hang (a loaded 2-core machine has taken
            # over 5 s to tear down a SIGKILLed follower)
            deadline = time.monotonic() + 60
            while not deaths and time.monotonic() < deadline:
                time.sleep(0.05)
            assert deaths == [(1, -9)]
            ranks.kill()
            destroy_tp(ranks.runner.tp)
        else:
            ranks.close()
            time.sleep(1.0)  # five polls of the watcher
            assert deaths == [] and [p.exitcode for p in ranks.procs] == [0]
