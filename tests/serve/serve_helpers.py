"""Shared pieces of the `splitserve serve / generate / bench` tests: how to run a command, the
worker flags of the tiny model, the `serve` subprocess, and the single-process oracle."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

BLOCK_SIZE = 4
MAX_MODEL_LEN = 256
ENGINE_FLAGS = [
    "--device",
    "cpu",
    "--num-blocks",
    "128",
    "--block-size",
    str(BLOCK_SIZE),
    "--max-model-len",
    str(MAX_MODEL_LEN),
]
START_TIMEOUT_S = 240.0


def cli(subcommand: str) -> list[str]:
    """argv prefix of `splitserve <subcommand>`: through cli/main.py once it registers the
    command, else the command module's stand-alone entry."""
    from splitserve.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a.choices, dict))
    if subcommand in sub.choices:
        return [sys.executable, "-m", "splitserve.cli.main", subcommand]
    return [sys.executable, "-m", f"splitserve.cli.{subcommand.replace('-', '_')}_cmd"]


def run_cli(subcommand: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*cli(subcommand), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"},
    )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Serve:
    """A running `splitserve serve` subprocess; stderr goes to a file (progress lines)."""

    proc: subprocess.Popen
    stderr_path: Path
    address: str = ""
    stdout_lines: list[str] = field(default_factory=list)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def child_pids(self) -> dict[str, int]:
        """name -> pid from the `started NAME on ADDR (pid N, ...)` progress lines (the last start wins)."""
        return {
            m[1]: int(m[2]) for m in re.finditer(r"started (\S+) on \S+ \(pid (\d+)", self.stderr())
        }

    def __post_init__(self) -> None:
        def pump() -> None:
            for line in self.proc.stdout:
                self.stdout_lines.append(line.rstrip("\n"))

        threading.Thread(target=pump, daemon=True).start()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.stdout_lines):
                m = re.match(r"ready: router on (\S+)", line)
                if m:
                    self.address = m[1]
                    return self.address
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"serve exited with {self.proc.returncode} before ready:\n{self.stderr()}"
                )
            time.sleep(0.2)
        raise AssertionError(f"serve not ready within {timeout}s:\n{self.stderr()}")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_serve(log_dir: Path, *args: str) -> Serve:
    log_dir.mkdir(parents=True, exist_ok=True)
    err = log_dir / "serve.stderr"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [*cli("serve"), *args, "--log-dir", str(log_dir)],
            stdout=subprocess.PIPE,
            stderr=f,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"},
        )
    return Serve(proc, err)


def make_oracle(model):
    """(prompt text, max_tokens) -> greedy Completion of the single-process engine."""
    from splitserve.config.engine_config import EngineConfig
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.offline import OfflineEngine
    from splitserve.request.sampling_params import SamplingParams
    from splitserve.request.tokenizer import Tokenizer

    runner = ModelRunner(
        EngineConfig(
            model_path=str(model),
            device="cpu",
            cache={"num_blocks": 256, "block_size": BLOCK_SIZE},
            scheduler={"max_model_len": MAX_MODEL_LEN},
        )
    )
    engine = OfflineEngine(runner, Tokenizer.from_dir(model))

    def generate(text: str, max_tokens: int):
        [done] = engine.generate(
            [engine.tokenizer.encode(text)],
            [SamplingParams(max_tokens=max_tokens, temperature=0.0)],
        )
        return done

    return generate
