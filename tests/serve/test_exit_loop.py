"""The quick start ends cleanly under load, run after run: `splitserve serve --prompt` answers and
exits 0, every service it started has finished its stop (logged "... stopped", the line before
its os._exit) within 10 s of its SIGTERM, and every process is gone when serve exits,
while busy processes keep both cores loaded. A worker that hung at exit (garbage collection of
a ucxx listener, gRPC threads) failed about 3 runs in 33 before service_process.py.

What the 10 s bounds is the services' own stop; after it, each process must leave user space
within EXIT_STACKS_AFTER_S (3 s: service_process.exit_now's watchdog dumps the stacks of a
process still running Python then, which fails the test). The kernel's teardown of a process that has
called os._exit is the VM's: on this 2-core Firecracker VM it took up to 5.3 s (os._exit at T,
zombie at T + 5.3 s, while another process kept running undisturbed) and 15 s on fresh CI (a
router that logged "stopped" 3 ms after SIGTERM), so serve's whole exit (reaping included) has a
60 s hang guard instead; the launcher starts the next stage once a child is out of user space
(cli/launcher.py: PF_EXITING), so those teardowns overlap instead of adding up.

CI runs EXIT_LOOP_RUNS (3) rounds; set SPLITSERVE_EXIT_LOOP=20 for the full check by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from datetime import datetime

from serve_helpers import ENGINE_FLAGS, cli, pid_alive

EXIT_LOOP_RUNS = int(os.environ.get("SPLITSERVE_EXIT_LOOP", "3"))
STOPPED_WITHIN_S = 10.0  # each service's stop, by its own log
EXITED_WITHIN_S = 60.0  # serve's exit, children reaped: a hang guard (see the docstring)
SIGTERM_LINE = re.compile(r"^(\S+ \S+) INFO \S+: received SIGTERM", re.M)
STOPPED_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+: .* stopped$", re.M)


def _cpu_hogs(n: int) -> list[subprocess.Popen]:
    # niced a little: the load must not starve the services past the 10 s bound, only crowd them
    return [
        subprocess.Popen([sys.executable, "-c", "import os; os.nice(5)\nwhile True: pass"])
        for _ in range(n)
    ]


def _one_round(model, log_dir) -> tuple[int, float, float, list[int], str]:
    """(exit code, seconds from 'stopping services' to the exit, its wall-clock time, pids
    started, stderr)."""
    cmd = [
        *cli("serve"),
        "--model",
        str(model),
        "--port",
        "0",
        *ENGINE_FLAGS,
        "--log-dir",
        str(log_dir),
        "--prompt",
        "Hello, splitserve",
        "--max-tokens",
        "8",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"},
    )
    lines, stopping, stopping_at = [], [], []

    def read() -> None:  # each line with its arrival time, so a slow stop says where it went
        for line in proc.stderr:
            now = time.monotonic()
            if "stopping services" in line:
                stopping.append(now)
                stopping_at.append(time.time())
                line = f"[{time.strftime('%H:%M:%S')}] {line}"  # to compare with the logs' times
            since = f"+{now - stopping[0]:.2f}s " if stopping else ""
            lines.append(since + line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait(timeout=300)
    ended = time.monotonic()
    reader.join(10)
    err = "".join(lines)
    if stopping:
        err += f"+{ended - stopping[0]:.2f}s (the process exited)\n"
    pids = [int(p) for p in re.findall(r"started \S+ on \S+ \(pid (\d+)", err)]
    if not stopping:
        return code, float("inf"), 0.0, pids, err
    return code, ended - stopping[0], stopping_at[0], pids, err


def _stop_seconds(log_dir) -> dict[str, float]:
    """Each service's seconds from its "received SIGTERM" line to its "... stopped" line (the
    workers get SIGTERM once the router is out of user space, so "stopping services" is no
    start line for them)."""
    out = {}
    for log in sorted(log_dir.glob("*.log")):
        text = log.read_text(errors="replace")
        got, stopped = SIGTERM_LINE.findall(text), STOPPED_LINE.findall(text)
        if not got or not stopped:
            out[log.stem] = float("inf")
            continue
        at = [
            datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp() for t in (got[-1], stopped[-1])
        ]
        out[log.stem] = at[1] - at[0]
    return out


def _log_tails(log_dir, lines: int = 60) -> str:
    """The last lines of each service's log (timestamped): which one was slow to go."""
    return "".join(
        f"--- {log.name}\n" + "".join(log.read_text(errors="replace").splitlines(True)[-lines:])
        for log in sorted(log_dir.glob("*.log"))
    )


def test_quick_start_exits_cleanly_under_load(tiny_llama, tmp_path):
    hogs = _cpu_hogs(os.cpu_count() or 2)
    try:
        for i in range(EXIT_LOOP_RUNS):
            run = tmp_path / f"run{i}"
            code, exit_s, stopping_at, pids, err = _one_round(tiny_llama, run)
            assert code == 0, f"run {i}: exit {code}\n{err}"
            assert len(pids) == 3 and not [p for p in pids if pid_alive(p)], (
                f"run {i}: left running\n{err}"
            )
            stops = _stop_seconds(run)
            assert set(stops) == {"router", "prefill-0", "decode-0"}, stops
            assert max(stops.values()) < STOPPED_WITHIN_S, (
                f"run {i}: a service's stop took too long: {stops}\n{err}{_log_tails(run)}"
            )
            # nothing of ours ran on after its stop: a process still in Python EXIT_STACKS_AFTER_S
            # into exit_now would have dumped its threads' stacks into its log (faulthandler)
            stuck = [log.name for log in run.glob("*.log") if "Timeout (" in log.read_text()]
            assert not stuck, f"run {i}: still running after its exit began: {stuck}\n{err}"
            assert exit_s < EXITED_WITHIN_S, (
                f"run {i}: serve's exit took {exit_s:.1f}s\n{err}{_log_tails(run)}"
            )
            assert "did not stop" not in err, err
    finally:
        for h in hogs:
            h.kill()
            h.wait()
