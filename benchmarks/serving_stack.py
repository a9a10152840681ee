"""One `splitserve serve` per mode for serving_compare.py, kept up across every rate and repeat.

    stack = ServeStack.start(mode, flags, env, log_dir)  # returns once it printed `ready:`
    stack.address                                         the router
    stack.workers                                         worker name -> address (serve's lines)
    stack.kv_free()                                       every worker's blocks free, no lease
    stack.stop()                                          SIGTERM, then its exit code

A serve that exits or stays unready past the timeout is a ServeError with its last log lines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

READY = re.compile(r"^ready: router on (\S+)", re.M)
HEALTHY = re.compile(r"^  ((?:prefill|decode)-\d+)\s+healthy on (\S+) after", re.M)


class ServeError(RuntimeError):
    """serve did not start, or died: one line, then its log tail."""


@dataclass
class ServeStack:
    mode: str
    proc: subprocess.Popen
    out_path: Path
    err_path: Path
    address: str = ""
    workers: dict[str, str] = field(default_factory=dict)
    started_s: float = 0.0
    gpu_sharing: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        mode: str,
        flags: list[str],
        env: dict[str, str],
        log_dir: Path,
        timeout_s: float = 600.0,
        say=print,
    ) -> ServeStack:
        log_dir.mkdir(parents=True, exist_ok=True)
        out_path, err_path = log_dir / "serve.stdout", log_dir / "serve.stderr"
        cmd = [sys.executable, "-m", "splitserve.cli.main", "serve", *flags]
        cmd += ["--port", "0", "--no-http", "--log-dir", str(log_dir)]
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", **env},
            )
        stack = cls(mode, proc, out_path, err_path)
        t0 = time.monotonic()
        last = t0
        while not (ready := READY.search(out_path.read_text(errors="replace"))):
            if proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                what = "exited" if proc.poll() is not None else f"not ready after {timeout_s:g}s"
                stack.stop()
                raise ServeError(f"serve ({mode}) {what}; its log ends:\n{stack.log_tail()}")
            if time.monotonic() - last > 30:  # long GPU start-ups: say it is still going
                last = time.monotonic()
                say(f"[{mode}] serve still starting ({last - t0:.0f}s)", flush=True)
            time.sleep(0.2)
        stack.address = ready.group(1)
        said = err_path.read_text(errors="replace")
        stack.workers = dict(HEALTHY.findall(said))
        # how the GPU is shared, as serve said it (MPS joined / started / missing); kept in the JSON
        stack.gpu_sharing = [line.strip() for line in said.splitlines() if "MPS:" in line]
        stack.started_s = time.monotonic() - t0
        return stack

    def log_tail(self, chars: int = 3000) -> str:
        return self.err_path.read_text(errors="replace")[-chars:]

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ServeError(
                f"serve ({self.mode}) exited with {self.proc.returncode}; its log ends:\n"
                + self.log_tail()
            )

    def kv_free(self, wait_s: float = 10.0) -> dict[str, bool]:
        """Per worker: every KV block free and no lease held (polled up to wait_s: GetLoad gives
        the last step's snapshot)."""
        import grpc

        from splitserve.protos import worker_pb2, worker_pb2_grpc

        out = {}
        for name, address in self.workers.items():
            stub_of = (
                worker_pb2_grpc.PrefillWorkerStub
                if name.startswith("prefill")
                else worker_pb2_grpc.DecodeWorkerStub
            )
            deadline = time.monotonic() + wait_s
            with grpc.insecure_channel(address) as channel:
                stub = stub_of(channel)
                while True:
                    load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
                    free = load.free_blocks == load.total_blocks and load.leases_held == 0
                    if free or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
            out[name] = free
        return out

    def stop(self, timeout_s: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()
