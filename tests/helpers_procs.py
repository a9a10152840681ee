"""Real service processes for integration tests: free ports, `splitserve <command>` subprocesses
with their output in a log file, waiting for grpc.health.v1 SERVING, SIGTERM stops, and a
kill of whatever is left at teardown.

    with ProcessGroup(tmp_path) as procs:
        p = procs.prefill_worker(model, "--num-blocks", "64")
        d = procs.decode_worker(model)
        ... p.address, d.address ...
        assert p.stop() == 0            # SIGTERM, drain, exit code
    # anything still running is killed here

Import it from a test module as `import helpers_procs` (tests/ is on sys.path through its
conftest.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.service.net import free_port  # noqa: F401 - the tests' port picker
from splitserve.service.tls import TlsClientConfig, open_channel

# subcommand -> (gRPC service whose health means "ready", stand-alone module for commands that
# cli/main.py does not register yet)
SERVICES = {
    "prefill-worker": ("splitserve.v1.PrefillWorker", None),
    "decode-worker": ("splitserve.v1.DecodeWorker", "splitserve.cli.decode_worker_cmd"),
    "router": ("splitserve.v1.GenerateService", "splitserve.cli.router_cmd"),
}
START_TIMEOUT_S = 90.0
PORT_TAKEN = "cannot listen on"  # GrpcServer's message when the port is in use
PORT_RETRIES = 3


def cli_command(subcommand: str) -> list[str]:
    """argv prefix running `splitserve <subcommand>`: through cli/main.py when it registers the
    command, else through the command's stand-alone module."""
    from splitserve.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a.choices, dict))  # the subparsers action
    if subcommand in sub.choices:
        return [sys.executable, "-m", "splitserve.cli.main", subcommand]
    module = SERVICES.get(subcommand, (None, None))[1]
    if module is None:
        raise LookupError(f"`splitserve {subcommand}` does not exist")
    return [sys.executable, "-m", module]


def health_status(
    address: str, service: str = "", timeout: float = 2.0, tls: TlsClientConfig | None = None
) -> int | None:
    """The health status of `service` at `address`, None when it does not answer (`tls`: for a
    service started with --tls-cert-file)."""
    with open_channel(address, tls, aio=False) as channel:
        try:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
                .status
            )
        except grpc.RpcError:
            return None


@dataclass
class ServiceProcess:
    name: str
    proc: subprocess.Popen
    address: str
    service: str
    log_path: Path
    _log_file: object = field(repr=False, default=None)
    _relaunch: Callable[[ServiceProcess], None] | None = field(repr=False, default=None)
    tls: TlsClientConfig | None = None  # how its health is checked
    _log_start: int = field(repr=False, default=0)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _log_since_launch(self) -> str:
        data = self.log_path.read_bytes() if self.log_path.exists() else b""
        return data[self._log_start :].decode(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until health says SERVING. A process that lost its port to another binder between
        free_port() and its bind (other test runs share the machine) is started again on a new
        port, up to PORT_RETRIES times; `address` follows."""
        deadline = time.monotonic() + timeout
        retries = PORT_RETRIES
        serving = health_pb2.HealthCheckResponse.SERVING
        while health_status(self.address, self.service, tls=self.tls) != serving:
            if not self.alive():
                if (
                    retries
                    and self._relaunch is not None
                    and PORT_TAKEN in self._log_since_launch()
                ):
                    retries -= 1
                    self._close_log()
                    self._relaunch(self)
                    continue
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode} before serving:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not SERVING within {timeout}s:\n{self.log()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait for the drain; the exit code (killed after `timeout`: AssertionError)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.name} did not exit within {timeout}s of SIGTERM:\n{self.log()}"
            ) from None
        finally:
            self._close_log()

    def kill(self) -> None:
        """SIGKILL (a crash, as far as its peers can tell)."""
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its threads so far (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_share(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each process's CPU time over the next `seconds`, as a share of one core."""
    start = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return {name: (cpu_seconds(pid) - start[name]) / wall for name, pid in pids.items()}


class ProcessGroup:
    """Starts service processes; on exit kills every one still running."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[ServiceProcess] = []

    def start(
        self,
        subcommand: str,
        *args: str,
        name: str | None = None,
        port: int | None = None,
        wait: bool = True,
        timeout: float = START_TIMEOUT_S,
        tls: TlsClientConfig | None = None,
    ) -> ServiceProcess:
        """Starts `splitserve <subcommand> --host 127.0.0.1 --port P *args`; with wait, returns once
        its health says SERVING (else call `wait_serving()` yourself); `tls`: how a service that
        serves TLS is checked."""
        name = name or f"{subcommand}-{len(self.procs)}"
        fixed_port = port is not None
        sp = ServiceProcess(name, None, "", SERVICES[subcommand][0], self.log_dir / f"{name}.log")  # type: ignore
        sp.tls = tls

        def launch(target: ServiceProcess, chosen: int | None = None) -> None:
            target_port = chosen or free_port()
            target._log_start = target.log_path.stat().st_size if target.log_path.exists() else 0
            target._log_file = open(target.log_path, "a")  # noqa: SIM115 - closed by stop()/kill()
            cmd = [
                *cli_command(subcommand),
                "--host",
                "127.0.0.1",
                "--port",
                str(target_port),
                *args,
            ]
            env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}
            target.proc = subprocess.Popen(
                cmd, stdout=target._log_file, stderr=subprocess.STDOUT, env=env
            )
            target.address = f"127.0.0.1:{target_port}"

        launch(sp, port)
        sp._relaunch = None if fixed_port else launch
        self.procs.append(sp)
        if wait:
            sp.wait_serving(timeout)
        return sp

    def prefill_worker(self, model, *args: str, **kw) -> ServiceProcess:
        return self.start("prefill-worker", "--model", str(model), "--device", "cpu", *args, **kw)

    def decode_worker(self, model, *args: str, **kw) -> ServiceProcess:
        return self.start("decode-worker", "--model", str(model), "--device", "cpu", *args, **kw)

    def router(self, model, *args: str, **kw) -> ServiceProcess:
        return self.start("router", "--model", str(model), *args, **kw)

    def close(self) -> None:
        for sp in self.procs:
            sp.kill()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def all_free(stub) -> None:
    """Every block free and no lease held on a worker (GetLoad reports the last step's snapshot:
    polled for up to 5 s)."""
    from splitserve.protos import worker_pb2

    for _ in range(50):
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
        if load.free_blocks == load.total_blocks and load.leases_held == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"blocks or leases still held: {load}")


def offline_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The oracle of the process tests: greedy tokens (ignore_eos) from one in-process engine."""
    from splitserve.config.engine_config import EngineConfig
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.offline import OfflineEngine
    from splitserve.request.sampling_params import SamplingParams

    runner = ModelRunner(
        EngineConfig(model_path=str(model_dir), cache={"num_blocks": 128, "block_size": 4})
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [c.token_ids for c in OfflineEngine(runner).generate(prompts, [params] * len(prompts))]
