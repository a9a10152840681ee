"""One child service process of `splitserve serve` (cli/launcher.py starts and stops it): where it
listens, its process, its grpc.health.v1 status and the tail of its log file.

    Child(name, subcommand, args, service, host)   args: without --host/--port, or a callable
                                                   that sees the other children's addresses;
                                                   health checked over TLS with `tls`
    log_tail(path, lines, since)                   the last non-empty log lines, on one line
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.service.net import local_dial_host
from splitserve.service.tls import TlsClientConfig, open_channel

PORT_RETRIES = 3
TAIL_LINES = 3


def log_tail(path: Path, lines: int = TAIL_LINES, since: int = 0, width: int = 300) -> str:
    """The last `lines` non-empty lines of a log file, joined by ' | ' (one line)."""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    tail = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
    return " | ".join(ln if len(ln) <= width else ln[:width] + "..." for ln in tail)


@dataclass(eq=False)
class Child:
    name: str
    subcommand: str
    args: (
        Callable[[], list[str]] | list[str]
    )  # without --host/--port; a callable sees current addresses
    service: str  # grpc.health.v1 service whose SERVING means ready
    host: str
    fixed_port: int | None = None
    depends_on: tuple[Child, ...] = ()  # relaunched (new addresses) when one of these is
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path = Path()
    healthy: bool = False
    started: float = 0.0
    retries: int = PORT_RETRIES
    tls: TlsClientConfig | None = None  # how its health is checked; None: plaintext
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's (e.g. MPS share)
    _log_start: int = 0
    _log_file: object = field(default=None, repr=False)
    _channel: grpc.Channel | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        """Where to dial it (loopback when it binds every interface)."""
        return f"{local_dial_host(self.host)}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        return log_tail(self.log_path, since=self._log_start)

    def health(self, timeout: float = 1.0) -> int | None:
        if self._channel is None:
            self._channel = open_channel(self.address, self.tls, aio=False)
        try:
            return (
                health_pb2_grpc.HealthStub(self._channel)
                .Check(health_pb2.HealthCheckRequest(service=self.service), timeout=timeout)
                .status
            )
        except grpc.RpcError:
            return None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
