"""Child service processes of `splitserve serve`: start, wait until healthy, watch, stop.

    Launcher(log_dir, tls=None)                tls: TLS of the children's health checks
      .add(name, subcommand, args, service)    `splitserve <subcommand> --host H --port P args`
      .start_all()                             every child at once; output -> log_dir/<name>.log
      .wait_healthy(timeout, stop_event)       grpc.health.v1 SERVING for each child's service;
                                               a child that lost its port to another binder is
                                               relaunched on a new one (and its dependents too)
      .check_alive()                           StartError when a child died while serving
      .stop(grace_s)                           SIGTERM in order (router first, workers next,
                                               each stage once the previous one is exiting),
                                               SIGKILL the stragglers' process groups, reap all

No orphans: every child runs in its own process group (a terminal Ctrl-C reaches only the
launcher, which stops the children in order) and sets PR_SET_PDEATHSIG=SIGTERM on itself at
start (service/service_process.py: die_with_launcher), so even a launcher killed with SIGKILL
takes its children with it. One child's state, health check and log tail: cli/launcher_child.py.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from grpc_health.v1 import health_pb2

from splitserve.cli.launcher_child import Child
from splitserve.service.net import free_port
from splitserve.service.service_process import PARENT_ENV
from splitserve.service.tls import TlsClientConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
PORT_TAKEN = "cannot listen on"  # GrpcServer's message when the port is in use
SLOW_EXIT_S = 2.0  # a child slower than this to leave user space (or to close) is reported


class StartError(RuntimeError):
    """A child failed: one line naming it, its exit code and its last log lines."""


def cli_argv(subcommand: str) -> list[str]:
    """argv prefix running `splitserve <subcommand>` with this interpreter: the command's own
    module when it is runnable alone (it defines main()), else through cli/main.py."""
    module = f"splitserve.cli.{subcommand.replace('-', '_')}_cmd"
    try:
        runnable = hasattr(importlib.import_module(module), "main")
    except ImportError:
        runnable = False
    return (
        [sys.executable, "-m", module]
        if runnable
        else [sys.executable, "-m", "splitserve.cli.main", subcommand]
    )


_PF_EXITING = 0x4  # task flag: the process is in the kernel's exit path (include/linux/sched.h)


def _exiting(pid: int) -> bool:
    """Whether `pid` has left user space for good (its exit has begun in the kernel)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        return int(after_name[6]) & _PF_EXITING != 0  # field 9, `flags`
    except (OSError, ValueError, IndexError):
        return False


def _exited_unreaped(proc: subprocess.Popen, deadline: float) -> bool:
    """Waits until `proc` has exited or is exiting, or `deadline`, leaving it unreaped (a zombie
    keeps its pid and process group id, so a following killpg cannot hit a stranger); True when
    it did. Exiting counts: the kernel's teardown of a process that has called _exit took up to
    15 s on a loaded 2-core VM, time in which it runs none of our code."""
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:
            return True
        if _exiting(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


class Launcher:
    def __init__(
        self,
        log_dir: str | Path,
        on_event: Callable[[str], None] | None = None,
        env: dict[str, str] | None = None,
        tls: TlsClientConfig | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.tls = tls
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self._say = on_event or (lambda msg: None)
        self._env = {
            **os.environ,
            "UCX_WARN_UNUSED_ENV_VARS": "n",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }

    def add(
        self,
        name: str,
        subcommand: str,
        args,
        service: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        depends_on: tuple[Child, ...] = (),
        env: dict[str, str] | None = None,
    ) -> Child:
        child = Child(
            name,
            subcommand,
            args,
            service,
            host,
            fixed_port=port or None,
            depends_on=depends_on,
            log_path=self.log_dir / f"{name}.log",
            tls=self.tls,
            env=dict(env or {}),
        )
        child.port = port or free_port(host)
        self.children.append(child)
        return child

    # ---- start -------------------------------------------------------------------------------------
    def launch(self, child: Child) -> None:
        child.close()
        child.healthy = False
        child._log_file = open(child.log_path, "ab")  # noqa: SIM115 - closed by Child.close()
        args = child.args() if callable(child.args) else child.args
        cmd = [*cli_argv(child.subcommand), "--host", child.host, "--port", str(child.port), *args]
        child._log_file.write(f"$ {' '.join(cmd)}\n".encode())
        child._log_file.flush()
        child._log_start = child._log_file.tell()  # tails show the child's output, not the command
        # no preexec_fn (Python between fork and exec, next to live gRPC threads): the child sets
        # its own death signal from PARENT_ENV (service/service_process.py)
        env = {**self._env, **child.env, PARENT_ENV: str(os.getpid())}
        child.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=child._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0,
        )
        child.started = time.monotonic()
        self._say(
            f"started {child.name} on {child.address} (pid {child.pid}, log {child.log_path})"
        )

    def start_all(self) -> None:
        for child in self.children:
            self.launch(child)

    def _relaunch_on_new_port(self, child: Child) -> None:
        child.retries -= 1
        child.port = free_port(child.host)
        self._say(f"{child.name}: port taken by another process; retrying on {child.address}")
        self.launch(child)
        for other in self.children:
            if child in other.depends_on and other.proc is not None:
                self._terminate([other], grace_s=5.0)
                self.launch(other)

    def _failed(self, child: Child, what: str) -> StartError:
        tail = child.tail()
        return StartError(
            f"{child.name} {what} (exit code {child.proc.returncode})"
            f"{': ' + tail if tail else ''} [log: {child.log_path}]"
        )

    def wait_healthy(
        self,
        timeout: float,
        stop: threading.Event | None = None,
        on_healthy: Callable[[Child], None] | None = None,
        on_poll: Callable[[], None] | None = None,
        poll_s: float = 0.2,
    ) -> None:
        """Returns once every child's service is SERVING; StartError when one exits first, or at
        `timeout`; KeyboardInterrupt when `stop` is set meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            for child in self.children:
                if child.healthy:
                    continue
                if not child.alive():
                    if (
                        child.fixed_port is None
                        and child.retries > 0
                        and PORT_TAKEN in child.tail()
                    ):
                        self._relaunch_on_new_port(child)
                        continue
                    raise self._failed(child, "exited before it was healthy")
                if child.health() == SERVING:
                    child.healthy = True
                    if on_healthy:
                        on_healthy(child)
            if all(c.healthy for c in self.children):
                return
            if on_poll is not None:
                on_poll()
            if time.monotonic() > deadline:
                waiting = ", ".join(
                    f"{c.name} [log: {c.log_path}]" for c in self.children if not c.healthy
                )
                raise StartError(
                    f"not healthy within {timeout:.0f}s: {waiting}; raise --start-timeout if the "
                    "model is large, else see the log"
                )
            if stop is not None and stop.wait(poll_s):
                raise KeyboardInterrupt
            if stop is None:
                time.sleep(poll_s)

    def check_alive(self) -> None:
        """StartError naming the first child that exited while it should be serving."""
        for child in self.children:
            if not child.alive():
                raise self._failed(child, "exited unexpectedly")

    # ---- stop --------------------------------------------------------------------------------------
    def _terminate(self, children: list[Child], grace_s: float, reap: bool = True) -> None:
        """SIGTERM `children`, wait until each has exited or is exiting (else SIGKILL its group),
        then reap them (`reap`), or leave that to the caller."""
        for child in children:
            if child.alive():
                child.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        deadline = sent + grace_s
        for child in children:
            if child.proc is None or child.proc.returncode is not None:  # reaped already
                child.close()
                continue
            if not _exited_unreaped(child.proc, deadline):
                self._say(f"{child.name} did not stop within {grace_s:.0f}s of SIGTERM; killing it")
            elif (took := time.monotonic() - sent) > SLOW_EXIT_S:  # say it: a slow exit is a defect
                self._say(f"{child.name} took {took:.1f}s to exit after SIGTERM (see its log)")
            # the child is a zombie or still running, so its process group id is still ours:
            # kill whatever it left behind in the group (or it, when it ignored SIGTERM)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            if reap:
                self._reap(child)

    def _reap(self, child: Child) -> None:
        if child.proc is not None:
            child.proc.wait()
        closing = time.monotonic()
        child.close()
        if (took := time.monotonic() - closing) > SLOW_EXIT_S:
            self._say(f"closing {child.name}'s health channel took {took:.1f}s")

    def stop(
        self, grace_s: float = 30.0, first: tuple[str, ...] = ("router",)
    ) -> dict[str, int | None]:
        """SIGTERM the `first` subcommands (the router drains its streams), then the rest;
        kill what is left after `grace_s` per stage. Idempotent; returns name -> exit code."""
        head = [c for c in self.children if c.subcommand in first]
        rest = [c for c in self.children if c.subcommand not in first]
        for stage in (head, rest):  # the next stage starts once this one is out of user space
            self._terminate(stage, grace_s, reap=False)
        for child in self.children:  # the kernel tears them down at once: wait for the slowest
            self._reap(child)
        return {c.name: (c.proc.returncode if c.proc is not None else None) for c in self.children}
