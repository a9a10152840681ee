"""Keeps a worker registered with a router: RegisterWorker, then Heartbeat at the interval the
router asks for; registers again when the router forgot it (restart, long silence) and
retries with backoff while the router is unreachable. A worker address the router cannot dial
is refused at once (FAILED_PRECONDITION naming --advertise-host): the sidecar exits with 2.

    python -m splitserve.router.registration --router ROUTER:50051 --role prefill --worker HOST:50061
        [--tls-ca-file CA.pem [--tls-cert-file CERT.pem --tls-key-file KEY.pem]]   # docs/tls.md

runs it as a sidecar next to a worker (a worker process itself must not import the router
package: docs/architecture.md, the import contracts); `keep_registered(...)` is the same loop as a
coroutine, e.g. for tests or a launcher script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.protos import generate_pb2, router_pb2, router_pb2_grpc
from splitserve.service.credentials import CredentialError, cluster_secret
from splitserve.service.grpc_service import channel_options
from splitserve.service.tls import TlsClientConfig, TlsError, open_channel
from splitserve.service.tls_flags import add_client_tls_arguments, client_tls_from_args

log = logging.getLogger("splitserve.registration")

ROLES = {"prefill": generate_pb2.WORKER_ROLE_PREFILL, "decode": generate_pb2.WORKER_ROLE_DECODE}


async def wait_for_worker(
    worker: str, timeout_s: float, tls: TlsClientConfig | None = None
) -> bool:
    """Until the worker's gRPC server answers at `worker` (any health answer will do), at most
    `timeout_s`. The router refuses an address it cannot dial, and a sidecar usually starts
    together with its worker: registering before the worker listens would be refused.
    `tls`: as for the router (one identity for both: service/tls.py); None: plaintext."""
    async with open_channel(worker, tls, channel_options()) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return False
        return True


async def keep_registered(
    router: str,
    role: str,
    worker: str,
    stop: asyncio.Event | None = None,
    call_timeout_s: float = 5.0,
    max_backoff_s: float = 10.0,
    worker_wait_s: float = 30.0,
    secret: bytes | None = None,
    tls: TlsClientConfig | None = None,
) -> None:
    """Runs until `stop` is set (or the task is cancelled). Errors that retrying cannot fix
    (INVALID_ARGUMENT, FAILED_PRECONDITION: e.g. the router cannot reach `worker`;
    PERMISSION_DENIED: a missing or wrong cluster secret) are raised.
    Waits up to `worker_wait_s` for the worker to answer at `worker` before registering.
    `secret`: the cluster secret the router asks for (None: none is sent).
    `tls`: TLS to the router and the worker (service/tls.py); None: plaintext."""
    stop = stop or asyncio.Event()
    metadata = (("authorization", f"Bearer {secret.decode()}"),) if secret else None
    role_id = ROLES[role]
    if worker_wait_s > 0 and not await wait_for_worker(worker, worker_wait_s, tls):
        log.warning(
            "%s worker not answering at %s after %.0fs; registering anyway (the router refuses an "
            "address it cannot dial)",
            role,
            worker,
            worker_wait_s,
        )
    async with open_channel(router, tls, channel_options()) as channel:
        stub = router_pb2_grpc.RouterControlStub(channel)
        interval, backoff, registered = 1.0, 0.5, False
        while not stop.is_set():
            try:
                if not registered:
                    got = await stub.RegisterWorker(
                        router_pb2.RegisterWorkerRequest(role=role_id, address=worker),
                        timeout=call_timeout_s,
                        metadata=metadata,
                    )
                    interval = max(0.05, got.heartbeat_interval_ms / 1000)
                    registered = True
                    log.info(
                        "registered %s worker %s with router %s (heartbeat every %.1fs)",
                        role,
                        worker,
                        router,
                        interval,
                    )
                else:
                    got = await stub.Heartbeat(
                        router_pb2.HeartbeatRequest(address=worker, role=role_id),
                        timeout=call_timeout_s,
                        metadata=metadata,
                    )
                    if not got.known:
                        log.warning(
                            "router %s forgot %s worker %s; registering again", router, role, worker
                        )
                        registered = False
                        continue
                backoff = 0.5
                wait = interval
            except grpc.aio.AioRpcError as err:
                if err.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.UNIMPLEMENTED,  # not the router's control port
                ):
                    raise
                log.warning(
                    "router %s unreachable (%s); retrying in %.1fs",
                    router,
                    err.code().name,
                    backoff,
                )
                registered = False
                wait, backoff = backoff, min(max_backoff_s, backoff * 2)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m splitserve.router.registration", description=__doc__.splitlines()[0]
    )
    p.add_argument("--router", required=True, metavar="HOST:PORT", help="the router's gRPC address")
    p.add_argument("--role", required=True, choices=sorted(ROLES))
    p.add_argument(
        "--worker",
        required=True,
        metavar="HOST:PORT",
        help="the worker's address as the router dials it",
    )
    p.add_argument(
        "--worker-wait-s",
        type=float,
        default=30.0,
        help="seconds to wait for the worker to answer before the first registration (default 30)",
    )
    p.add_argument(
        "--cluster-secret-file",
        metavar="FILE",
        help="the router's cluster secret (default: $SPLITSERVE_CLUSTER_SECRET_FILE or "
        "$SPLITSERVE_CLUSTER_SECRET; none: send none)",
    )
    add_client_tls_arguments(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    try:
        secret = cluster_secret(args.cluster_secret_file)
    except CredentialError as err:
        print(f"registration: error: {err}", file=sys.stderr)
        return 2
    try:
        tls = client_tls_from_args(args)
    except ValueError as err:  # --tls-* flags that do not fit together
        print(f"registration: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await keep_registered(
            args.router,
            args.role,
            args.worker,
            stop,
            worker_wait_s=args.worker_wait_s,
            secret=secret,
            tls=tls,
        )

    try:
        asyncio.run(run())
    except grpc.aio.AioRpcError as err:
        print(f"registration: error: {err.details()}", file=sys.stderr)
        return 2
    except TlsError as err:  # a --tls-* file that cannot be read or used
        print(f"registration: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
