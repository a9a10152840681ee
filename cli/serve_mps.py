"""One GPU shared by prefill and decode workers: `serve` runs them under NVIDIA MPS, each role
with its own share of the SMs and of the memory.

Two processes on one GPU without MPS time-slice it: a long prefill holds the whole GPU for its
slice and every decode step behind it waits. Measured on an H200 with warm caches (llama-3.2-1b,
benchmarks/results/h200-2026-12-04/serving_mps.json) the two are within noise at 16 and 48 req/s;
the gap MPS is for shows at higher load (issue "Disaggregation that wins"). Under MPS their kernels run at
the same time, each on at most its share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), and
each process may pin at most its share of the memory (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), which
also sizes its KV pool (the pool takes a fraction of what the process may still allocate).

    plan_mps(args, prefill_at, decode_at)  -> MpsPlan | None (None: nothing shares a GPU, --mps
                                              off, or MPS missing under --mps auto: one line says
                                              the workers time-slice)
    MpsPlan.start(say)                     joins a running control daemon (its pipe directory
                                           has a `control` pipe) or starts a private one (pipe and
                                           log directories of its own), and says which
    start_mps(plan, mode, say)             plan.start; a private daemon that fails to start (its
                                           control command exits non-zero, or it never answers)
                                           means time-slicing with one line under --mps auto, and
                                           a one-line error under --mps on
    MpsPlan.env(role)                      the worker's MPS variables
    MpsPlan.stop()                         quits the private daemon (a joined one is left running)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"  # where CUDA looks when CUDA_MPS_PIPE_DIRECTORY is unset
START_TIMEOUT_S = 15.0


def _device(flags: list[str]) -> str | None:
    return flags[flags.index("--device") + 1] if "--device" in flags else None


def _shared_cuda_device(prefill_at: list[list[str]], decode_at: list[list[str]]) -> str | None:
    """The CUDA device that a prefill and a decode worker both run on, if any."""
    prefill = {_device(f) for f in prefill_at}
    shared = [d for d in (_device(f) for f in decode_at) if d in prefill]
    return next((d for d in shared if d is not None and d.startswith("cuda")), None)


def check_shares(args: argparse.Namespace) -> None:
    """ValueError unless both shares are whole percents in 1..99 (before anything starts)."""
    for flag, value in (
        ("--prefill-sm-share", args.prefill_sm_share),
        ("--prefill-memory-share", args.prefill_memory_share),
    ):
        if not 1 <= value <= 99:
            raise ValueError(
                f"{flag} must be a percentage from 1 to 99 (decode takes the rest), got {value}"
            )


class MpsStartError(RuntimeError):
    """A private control daemon did not start (its directories already removed)."""


@dataclass
class MpsPlan:
    device_index: int
    total_bytes: int
    prefill_sm: int
    prefill_memory: int
    pipe_dir: Path | None = None
    log_dir: Path | None = None
    private: bool = False
    _tmp: Path | None = field(default=None, repr=False)

    def _control_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    def start(self, say: Callable[[str], None]) -> None:
        running = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR))
        if (running / "control").exists():
            self.pipe_dir = running
            self.log_dir = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
            say(f"MPS: joining the control daemon at {running}")
        else:
            # short paths: the daemon's unix sockets live in the pipe directory (108-byte limit)
            self._tmp = Path(tempfile.mkdtemp(prefix="splitserve-mps-"))
            self.pipe_dir, self.log_dir = self._tmp / "pipe", self._tmp / "log"
            self.pipe_dir.mkdir()
            self.log_dir.mkdir()
            try:
                done = subprocess.run(
                    [CONTROL, "-d"], env=self._control_env(), capture_output=True, text=True
                )
                code, err = done.returncode, " ".join(done.stderr.split())[:200]
            except OSError as exc:  # on PATH but not runnable
                code, err = None, str(exc)
            deadline = time.monotonic() + START_TIMEOUT_S
            while code == 0 and not (self.pipe_dir / "control").exists():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if not (self.pipe_dir / "control").exists():
                if code == 0:  # a daemon that may yet answer: ask it to quit (best effort)
                    self._quit(timeout=5)
                shutil.rmtree(self._tmp, ignore_errors=True)
                why = (
                    f"exit {code}" + (f": {err}" if err else "")
                    if code != 0
                    else f"no control pipe after {START_TIMEOUT_S:g}s"
                )
                raise MpsStartError(f"could not start an MPS control daemon ({CONTROL} -d: {why})")
            self.private = True
            say(f"MPS: started a private control daemon (pipe {self.pipe_dir})")
        say(
            f"MPS: prefill {self.prefill_sm}% of the SMs and {self.prefill_memory}% of the memory, "
            f"decode the rest (--prefill-sm-share / --prefill-memory-share)"
        )

    def env(self, role: str) -> dict[str, str]:
        sm = self.prefill_sm if role == "prefill" else 100 - self.prefill_sm
        memory = self.prefill_memory if role == "prefill" else 100 - self.prefill_memory
        limit_mib = self.total_bytes * memory // 100 // 2**20
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(sm),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{self.device_index}={limit_mib}M",
        }

    def _quit(self, timeout: float) -> None:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(
                [CONTROL],
                input="quit\n",
                env=self._control_env(),
                capture_output=True,
                text=True,
                timeout=timeout,
            )

    def stop(self) -> None:
        if not self.private:
            return
        self.private = False
        self._quit(timeout=30)
        deadline = time.monotonic() + 10
        while (self.pipe_dir / "control").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(self._tmp, ignore_errors=True)


def plan_mps(
    args: argparse.Namespace,
    prefill_at: list[list[str]],
    decode_at: list[list[str]],
    which: Callable[[str], str | None] = shutil.which,
    total_bytes: Callable[[int], int] | None = None,
) -> tuple[MpsPlan | None, str]:
    """(the plan, or None, and a line for the user: why not, '' when nothing to say)."""
    check_shares(args)
    if args.mps == "off":
        return None, ""
    device = _shared_cuda_device(prefill_at, decode_at)
    if device is None:
        if args.mps == "on":
            raise ValueError(
                "--mps on: no prefill and decode worker share a GPU here; MPS is for one GPU "
                "shared by both (use --mps auto)"
            )
        return None, ""
    if which(CONTROL) is None:
        if args.mps == "on":
            raise ValueError(f"--mps on: {CONTROL} is not on PATH; install it or use --mps off")
        return None, (
            f"MPS: {CONTROL} not found, so prefill and decode time-slice {device} "
            "(slower under load; install MPS or see docs/architecture.md)"
        )
    index = int(device.partition(":")[2] or 0)
    if total_bytes is None:
        import torch

        total = torch.cuda.get_device_properties(index).total_memory
    else:
        total = total_bytes(index)
    return MpsPlan(index, total, args.prefill_sm_share, args.prefill_memory_share), ""


def start_mps(plan: MpsPlan | None, mode: str, say: Callable[[str], None]) -> MpsPlan | None:
    """The started plan, or None: no plan, or (--mps auto) a daemon that would not start, said in
    one line. RuntimeError (one line) under --mps on."""
    if plan is None:
        return None
    try:
        plan.start(say)
    except MpsStartError as exc:
        if mode == "on":
            raise RuntimeError(f"--mps on: {exc}; pass --mps auto or off to time-slice") from None
        say(
            f"MPS: {exc}, so prefill and decode time-slice cuda:{plan.device_index} "
            "(slower under load; see docs/gpu_sharing.md)"
        )
        return None
    return plan
