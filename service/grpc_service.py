"""One grpc.aio server per process, the same for every service (workers and router).

    GrpcServer(cfg, registry)        health: all services NOT_SERVING
      .add(add_fn, servicer, name)
      await .start()                 bound (TLS when cfg.tls is set: service/tls.py);
                                     reflection on; metrics exporter up
      await .set_serving(True)       health: SERVING (after warm-up)
      await .serve_until_signal()    SIGTERM/SIGINT -> drain():
                                       health NOT_SERVING (for good), after
                                       `drain_announce_s` stop accepting,
                                       in-flight RPCs get `drain_grace_s` to finish,
                                       then they are cancelled and the server stops;
                                     the rest of the stop gets `stop_timeout_s`, then
                                     the process exits 3 (service_process.py)
      .drain_hooks                   coroutines drain() runs alongside, with the same grace
                                     (the router's HTTP front)

Health and reflection are the grpc libraries' own servicers; metrics are
prometheus-client's own HTTP exporter over the service's registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from prometheus_client import REGISTRY, CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, field_validator

from splitserve.service.grpc_guard import RejectMalformed
from splitserve.service.metrics_http import serve_metrics
from splitserve.service.net import advertised_host, is_wildcard
from splitserve.service.service_process import EXIT_DEADLINE
from splitserve.service.tls import TlsServerConfig, server_credentials

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServerConfig(BaseModel):
    """Where and how a service listens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(
        "127.0.0.1", min_length=1, description="address to bind; 0.0.0.0 for all interfaces"
    )
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    advertise_host: str | None = Field(
        None,
        min_length=1,
        description="host peers use to reach this one; "
        "None: `host`, or this machine's "
        "routable IP when `host` is 0.0.0.0",
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics port; None: off"
    )
    drain_grace_s: float = Field(
        30.0, ge=0, description="time in-flight RPCs get to finish on SIGTERM"
    )
    drain_announce_s: float = Field(
        0.0,
        ge=0,
        description="on SIGTERM, health says NOT_SERVING this long "
        "before the port closes, so health-polling load "
        "balancers and the router see the drain",
    )
    stop_timeout_s: float = Field(
        15.0,
        gt=0,
        description="after the drain, the rest of the stop (engine, UCX, "
        "ranks) gets this long; then the process logs the "
        "stuck threads' stacks and exits with status 3",
    )
    max_message_mb: int = Field(64, gt=0, le=2047)
    open_to_all: bool = Field(
        False,
        description="workers: serve callers without the cluster secret even when bound beyond "
        "loopback (by default such a worker refuses to start without one); the router's "
        "callers are governed by auth.*",
    )
    # a peer whose host vanished (link down, node lost) shows only through keepalive: 10 s + 5 s
    # bounds how long an open stream to it hangs (gRPC's 2 h default is far too long here)
    keepalive_time_s: float = Field(
        10.0, gt=0, description="ping an idle connection after this long"
    )
    keepalive_timeout_s: float = Field(
        5.0, gt=0, description="a ping unanswered this long closes the connection"
    )
    max_reconnect_backoff_s: float = Field(
        5.0,
        gt=0,
        description="longest wait between reconnect tries to a "
        "peer that was gone (gRPC's default: 120 s)",
    )
    tls: TlsServerConfig | None = Field(
        None,
        description="serve TLS with these PEM files (service/tls.py, docs/tls.md); None: plaintext",
    )

    @field_validator("advertise_host")
    @classmethod
    def _dialable(cls, v: str | None) -> str | None:
        if v is not None and is_wildcard(v):
            raise ValueError(
                f"{v} is no address a peer can dial; give this host's IP or DNS name as other hosts "
                "reach it, or leave it unset (the bound IP, or the routable IP when bound to all)"
            )
        return v

    @property
    def public_host(self) -> str:
        """The host peers should dial: advertise_host, else the bound IP; bound to every interface,
        the routable IP (default route's, else the first non-loopback one: service/net.py), never
        the host name, which peers often cannot resolve."""
        return advertised_host(self.host, self.advertise_host)


def _common_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    size = cfg.max_message_mb * 2**20
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(
    cfg: ServerConfig, max_receive_bytes: int | None = None
) -> list[tuple[str, int]]:
    """`max_receive_bytes`: a smaller cap on what a caller may send (a public listener: gRPC
    reads a whole message before any handler, or the key check in it, runs)."""
    options = _common_options(cfg) + [
        # accept the client pings that channel_options() sends
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(cfg.keepalive_time_s * 500)),
        # a second process on the same port must fail to bind, not share it silently
        ("grpc.so_reuseport", 0),
    ]
    if max_receive_bytes is not None:
        options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    return options


def channel_options(cfg: ServerConfig | None = None) -> list[tuple[str, int]]:
    """Options for a client channel to a splitserve service (same message size and keepalive;
    a peer back after an outage is dialled again within max_reconnect_backoff_s)."""
    cfg = cfg or ServerConfig()
    return _common_options(cfg) + [
        ("grpc.max_reconnect_backoff_ms", int(cfg.max_reconnect_backoff_s * 1000))
    ]


def service_name(file_descriptor, service: str) -> str:
    """Fully qualified gRPC service name, e.g. `splitserve.v1.PrefillWorker`."""
    return file_descriptor.services_by_name[service].full_name


class GrpcServer:
    def __init__(
        self,
        cfg: ServerConfig,
        registry: CollectorRegistry | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_receive_bytes: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.health = health.aio.HealthServicer()
        self._server = grpc.aio.server(
            options=server_options(cfg, max_receive_bytes), interceptors=list(interceptors)
        )
        self._names: list[str] = []
        self._metrics_http = None
        self._draining = False
        # run alongside the gRPC drain with the same grace (the router's HTTP front)
        self.drain_hooks: list[Callable[[float], Awaitable[None]]] = []
        self.port: int | None = None
        self.metrics_port: int | None = None

    @property
    def address(self) -> str:
        host = self.cfg.public_host
        bare_v6 = ":" in host and not host.startswith("[")
        return f"[{host}]:{self.port}" if bare_v6 else f"{host}:{self.port}"

    def add(self, add_to_server: Callable, servicer, name: str) -> None:
        add_to_server(
            servicer, RejectMalformed(self._server)
        )  # undecodable bytes: INVALID_ARGUMENT
        self._names.append(name)

    async def start(self) -> None:
        # health too: undecodable bytes are INVALID_ARGUMENT, not UNKNOWN and a logged traceback
        health_pb2_grpc.add_HealthServicer_to_server(self.health, RejectMalformed(self._server))
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(  # (enable_server_reflection,
            reflection.aio.ReflectionServicer(  # but through the guard as well)
                [*self._names, health.SERVICE_NAME, reflection.SERVICE_NAME]
            ),
            RejectMalformed(self._server),
        )
        await self.set_serving(False)
        target = f"{self.cfg.host}:{self.cfg.port}"
        # a bad certificate or key is TlsError (one line) here, before anything is bound
        creds = server_credentials(self.cfg.tls) if self.cfg.tls is not None else None
        try:
            if creds is None:
                self.port = self._server.add_insecure_port(target)
            else:
                self.port = self._server.add_secure_port(target, creds)
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise RuntimeError(
                f"cannot listen on {target}: the port is in use or the host is not a local "
                "address; pick another --port (0 picks a free one) or --host"
            )
        await self._server.start()
        if self.cfg.tls is not None:
            ca = self.cfg.tls.client_ca_file
            mutual = f"mutual: clients need a certificate signed by {ca}" if ca else "server-side"
            log.info("gRPC on %s over TLS (%s)", self.address, mutual)
        if self.cfg.metrics_port is not None:
            try:
                self._metrics_http = serve_metrics(
                    self.cfg.host, self.cfg.metrics_port, self.registry or REGISTRY
                )
            except RuntimeError:
                await self._server.stop(None)
                raise
            self.metrics_port = self._metrics_http.server_port

    async def set_serving(self, serving: bool) -> None:
        """Health of every service and of the server as a whole ('')."""
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self._names):
            await self.health.set(name, status)

    async def drain(self, grace_s: float | None = None) -> None:
        """NOT_SERVING for good, refuse new RPCs, give in-flight ones `grace_s`, then stop.
        Idempotent."""
        if self._draining:
            return
        self._draining = True
        grace = self.cfg.drain_grace_s if grace_s is None else grace_s
        EXIT_DEADLINE.arm(
            self.cfg.drain_announce_s + grace + self.cfg.stop_timeout_s,
            f"service on {self.address}",
        )
        await self.health.enter_graceful_shutdown()
        if (
            self.cfg.drain_announce_s
        ):  # still accepting: a poller reads NOT_SERVING, not a refused connection
            await asyncio.sleep(self.cfg.drain_announce_s)
        await asyncio.gather(self._server.stop(grace), *(hook(grace) for hook in self.drain_hooks))
        EXIT_DEADLINE.arm(
            self.cfg.stop_timeout_s, f"service on {self.address}"
        )  # the rest of the stop
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None

    async def serve_until_signal(
        self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)
    ) -> int:
        """Serves until one of `signals` (or until the server stops); drains; returns the signal number
        (0 when the server stopped by itself)."""
        loop = asyncio.get_running_loop()
        got: asyncio.Future[int] = loop.create_future()
        for sig in signals:
            loop.add_signal_handler(sig, lambda s=sig: got.done() or got.set_result(s))
        stopped = asyncio.ensure_future(self._server.wait_for_termination())
        try:
            await asyncio.wait([got, stopped], return_when=asyncio.FIRST_COMPLETED)
            received = got.result() if got.done() else 0
            if received:
                log.info(
                    "received %s: draining (grace %.1fs)",
                    signal.Signals(received).name,
                    self.cfg.drain_grace_s,
                )
            await self.drain()
            return received
        finally:
            stopped.cancel()
            for sig in signals:
                with contextlib.suppress(ValueError, RuntimeError):
                    loop.remove_signal_handler(sig)


async def run_service(service, name: str, log: logging.Logger) -> int:
    """The CLI entry of every service: start (stop cleanly if starting fails), log what serves,
    serve until SIGTERM/SIGINT, drain. `service` has start/stop/describe/serve_until_signal."""
    try:
        await service.start()
    except BaseException:
        await service.stop(0)
        raise
    log.info(service.describe())
    await service.serve_until_signal()
    log.info("%s stopped", name)
    return 0
