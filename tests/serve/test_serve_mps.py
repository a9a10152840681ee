"""`serve` and MPS (cli/serve_mps.py): when a prefill and a decode worker share a GPU they run
under an MPS control daemon with an SM and memory share each; missing MPS falls back to
time-slicing with one line (or an error under --mps on); bad shares are refused before anything
starts. The daemon's start and stop are checked against a stand-in `nvidia-cuda-mps-control`
(a script that makes and removes the control pipe as the real one does, or one that fails: --mps
auto then time-slices with one line, --mps on errors); the GPU test runs the real daemon."""

from __future__ import annotations

import argparse
import os
import re
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from serve_helpers import cli

from splitserve.cli import serve_cmd, serve_mps
from splitserve.cli.launcher import Launcher, StartError
from splitserve.cli.serve_args import add_arguments
from splitserve.cli.serve_mps import CONTROL, MpsPlan, plan_mps, start_mps

GIB = 2**30
SAME_GPU = ([["--device", "cuda:1"]], [["--device", "cuda:1"]])
FOUND = lambda name: f"/usr/bin/{name}"  # noqa: E731


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(
        **{"mps": "auto", "prefill_sm_share": 50, "prefill_memory_share": 30, **kw}
    )


def _plan(args, placement=SAME_GPU, which=FOUND):
    return plan_mps(args, *placement, which=which, total_bytes=lambda index: 100 * GIB)


@pytest.mark.parametrize("flag", ["prefill_sm_share", "prefill_memory_share"])
@pytest.mark.parametrize("value", [0, 100, -5])
def test_shares_out_of_range_are_refused(flag, value):
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} must be a percentage"):
        _plan(_args(**{flag: value}))


def test_shared_gpu_gets_a_plan_with_each_roles_share():
    plan, why = _plan(_args(prefill_sm_share=30, prefill_memory_share=25))
    assert why == "" and plan is not None
    plan.pipe_dir, plan.log_dir = Path("/p"), Path("/l")
    prefill, decode = plan.env("prefill"), plan.env("decode")
    assert prefill["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert decode["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
    # the device index of --device cuda:1, limits in MiB out of the 100 GiB given
    assert prefill["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"1={25 * 1024}M"
    assert decode["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"1={75 * 1024}M"
    assert prefill["CUDA_MPS_PIPE_DIRECTORY"] == decode["CUDA_MPS_PIPE_DIRECTORY"] == "/p"


@pytest.mark.parametrize(
    "placement",
    [
        ([["--device", "cpu"]], [["--device", "cpu"]]),
        ([["--device", "cuda:0"]], [["--device", "cuda:1"]]),  # a GPU each: nothing to share
        ([[]], [[]]),  # the workers' default device
    ],
)
def test_no_shared_gpu_no_mps_and_on_is_an_error(placement):
    assert _plan(_args(), placement) == (None, "")
    with pytest.raises(ValueError, match="no prefill and decode worker share a GPU"):
        _plan(_args(mps="on"), placement)


def test_missing_mps_time_slices_with_one_line_or_fails_under_on():
    plan, why = _plan(_args(), which=lambda name: None)
    assert plan is None and CONTROL in why and "time-slice" in why
    with pytest.raises(ValueError, match=f"{CONTROL} is not on PATH"):
        _plan(_args(mps="on"), which=lambda name: None)
    assert _plan(_args(mps="off")) == (None, "")


def _stand_in_control(bin_dir: Path, calls: Path) -> None:
    """`-d` makes the control pipe in $CUDA_MPS_PIPE_DIRECTORY; `quit` on stdin removes it."""
    script = bin_dir / CONTROL
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$* $CUDA_MPS_PIPE_DIRECTORY" >> {calls}\n'
        'if [ "$1" = "-d" ]; then mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi\n'
        'read cmd; [ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_a_private_daemon_is_started_and_quit(tmp_path, monkeypatch):
    _stand_in_control(tmp_path, tmp_path / "calls")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-daemon-here"))
    plan = MpsPlan(0, 10 * GIB, 50, 30)
    said: list[str] = []
    plan.start(said.append)
    pipe = plan.pipe_dir
    assert plan.private and (pipe / "control").exists() and "private" in said[0]
    assert plan.env("decode")["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
    plan.stop()
    assert not pipe.exists()  # quit, and its directories removed
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == [f"-d {pipe}", f" {pipe}"]


def test_a_running_daemon_is_joined_and_left_running(tmp_path, monkeypatch):
    _stand_in_control(tmp_path, tmp_path / "calls")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    running = tmp_path / "running"
    running.mkdir()
    os.mkfifo(running / "control")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(running))
    plan = MpsPlan(0, 10 * GIB, 50, 30)
    said: list[str] = []
    plan.start(said.append)
    plan.stop()
    assert not plan.private and "joining" in said[0]
    assert plan.env("prefill")["CUDA_MPS_PIPE_DIRECTORY"] == str(running)
    assert (running / "control").exists() and not (tmp_path / "calls").exists()


def _failing_control(bin_dir: Path, calls: Path, how: str) -> None:
    """`-d` exits 1 with a message ("exits 1"), or exits 0 and never makes the pipe ("silent")."""
    script = bin_dir / CONTROL
    start = 'echo "no GPU here" >&2; exit 1' if how == "exits 1" else "exit 0"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$* $CUDA_MPS_PIPE_DIRECTORY" >> {calls}\n'
        f'if [ "$1" = "-d" ]; then {start}; fi\n'
        "read cmd\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def failing_daemon(tmp_path, monkeypatch, request):
    """A control command that fails as request.param says; temp directories go to tmp_path/tmp
    (returned), and no host daemon is joined."""
    _failing_control(tmp_path, tmp_path / "calls", request.param)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-daemon-here"))
    monkeypatch.setattr(serve_mps, "START_TIMEOUT_S", 0.3)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path / "tmp"


@pytest.mark.parametrize("failing_daemon", ["exits 1", "silent"], indirect=True)
def test_a_daemon_that_will_not_start_time_slices_under_auto(failing_daemon, tmp_path):
    said: list[str] = []
    assert start_mps(MpsPlan(0, 10 * GIB, 50, 30), "auto", said.append) is None
    assert len(said) == 1 and "time-slice cuda:0" in said[0] and "\n" not in said[0], said
    cause = "exit 1: no GPU here" if "exit 1" in said[0] else "no control pipe after 0.3s"
    assert cause in said[0], said
    assert os.listdir(failing_daemon) == []  # its pipe and log directories removed
    calls = [c.split(" ")[0] for c in (tmp_path / "calls").read_text().splitlines()]
    # a silent daemon is asked to quit (no argument, "quit" on stdin), in case it answers late
    assert calls == (["-d"] if cause.startswith("exit") else ["-d", ""])


@pytest.mark.parametrize("failing_daemon", ["exits 1"], indirect=True)
def test_a_daemon_that_will_not_start_is_a_one_line_error_under_on(failing_daemon):
    with pytest.raises(RuntimeError, match="--mps on: could not start an MPS control daemon") as e:
        start_mps(MpsPlan(0, 10 * GIB, 50, 30), "on", lambda line: None)
    assert "\n" not in str(e.value) and "exit 1: no GPU here" in str(e.value)
    assert os.listdir(failing_daemon) == []


@pytest.mark.parametrize("failing_daemon", ["exits 1"], indirect=True)
def test_serve_starts_its_workers_without_mps_when_the_daemon_fails(
    failing_daemon, tmp_path, monkeypatch, capsys
):
    """serve_cmd.run with a shared GPU planned: one MPS line, then workers with no CUDA_MPS_*
    variables of their own (stopped before anything runs: no GPU needed)."""
    monkeypatch.setattr(serve_cmd, "plan_mps", lambda args, *_: _plan(args))
    monkeypatch.setattr(serve_cmd, "end_with_exit_now", lambda: None)
    envs: dict[str, dict[str, str]] = {}

    def start_all(launcher: Launcher) -> None:
        envs.update({c.name: c.env for c in launcher.children})
        raise StartError("stopped by the test")

    monkeypatch.setattr(Launcher, "start_all", start_all)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    logs = ["--log-dir", str(tmp_path / "logs"), "--port", "0"]  # (no port of the host's)
    args = parser.parse_args(["--mps", "auto", *logs, "--no-http"])
    with pytest.raises(RuntimeError, match="--mps on: could not start"):  # nothing started
        serve_cmd.run(parser.parse_args(["--mps", "on", *logs]))
    assert envs == {}
    capsys.readouterr()
    assert serve_cmd.run(args) == 1
    mps_lines = [line for line in capsys.readouterr().err.splitlines() if "MPS" in line]
    assert len(mps_lines) == 1 and "time-slice" in mps_lines[0], mps_lines
    workers = {n: e for n, e in envs.items() if n.startswith(("prefill", "decode"))}
    assert workers and all(not any(k.startswith("CUDA_MPS_") for k in e) for e in workers.values())
    assert os.listdir(failing_daemon) == []


def test_serve_refuses_a_bad_share_in_one_line(tiny_llama):
    done = subprocess.run(
        [*cli("serve"), "--model", str(tiny_llama), "--port", "0"]
        + ["--prefill-sm-share", "0", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 2 and len(errors) == 1 and "--prefill-sm-share" in errors[0]
    assert "Traceback" not in done.stderr


@pytest.mark.gpu
def test_serve_on_one_gpu_runs_under_its_own_mps_daemon(tiny_llama, tmp_path):
    """The real daemon: started, the workers' pools sized by their memory shares, the prompt
    answered, the daemon quit and its directories gone at exit."""
    if subprocess.run(["which", CONTROL], capture_output=True).returncode != 0:
        pytest.skip(f"{CONTROL} is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(tmp_path / "none")  # never join a daemon of the host
    # one GPU visible: on a host with more, serve would give each worker its own (no sharing)
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    done = subprocess.run(
        [
            *cli("serve"),
            *("--model", str(tiny_llama), "--device", "cuda", "--mps", "on", "--port", "0"),
            *("--log-dir", str(tmp_path / "logs"), "--prompt", "Hello", "--max-tokens", "8"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    pipe = re.search(r"private control daemon \(pipe (\S+)\)", done.stderr)
    assert pipe is not None, done.stderr
    assert not Path(pipe.group(1)).exists()  # quit and cleaned up
    blocks = {
        role: int(
            re.search(r"(\d+) KV blocks", (tmp_path / "logs" / f"{role}-0.log").read_text())[1]
        )
        for role in ("prefill", "decode")
    }
    assert blocks["prefill"] < blocks["decode"], blocks  # 30 % vs 70 % of the memory
