"""Can the router reach what a worker advertises? Checked when a worker registers (and, for a
prefill worker's KV listener, once per address by the probes), so that a worker advertising
an address its peers cannot dial (127.0.0.1, a container-internal IP, 0.0.0.0) fails loudly
at registration, naming --advertise-host, instead of at the first request or KV transfer.

    RegisterWorker(role, address)
      └─ health Check(role service) at `address`     UNAVAILABLE / DEADLINE_EXCEEDED: refused
      └─ prefill: GetLoad -> kv_address (UCX)        TCP connect fails: refused
                                                     port 0 (still loading): the probes check it

The KV listener is dialed with a bare TCP connect: UCX's sockaddr listener drops a connection
that sends nothing, and a refused or silent port is what a decode worker would see too.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.protos import worker_pb2, worker_pb2_grpc
from splitserve.request.errors import RequestError

ADVICE = (
    "start the worker with --advertise-host set to an IP or DNS name that the router and the other "
    "workers can dial (and give the same host to the registration sidecar's --worker)"
)


async def tcp_unreachable(host: str, port: int, timeout: float) -> str:
    """'' when a TCP connection to host:port opens within `timeout`, else why not."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), port), timeout)
    except TimeoutError:
        return f"no answer within {timeout:g}s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), timeout)
    except (TimeoutError, OSError):
        pass
    return ""


def kv_unreachable_message(address: str, kv: str, why: str) -> str:
    return (
        f"prefill worker {address} advertises its KV (UCX) listener at {kv}, which the router cannot reach "
        f"({why}); decode workers would fail at the first transfer: {ADVICE}"
    )


async def check_reachable(
    channel: grpc.aio.Channel,
    role_name: str,
    service: str,
    address: str,
    timeout: float,
    check_kv: bool,
) -> None:
    """Raises RequestError(FAILED_PRECONDITION) when the worker at `address` (over `channel`), or
    a prefill worker's advertised KV listener, cannot be reached from here."""
    try:
        await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.aio.AioRpcError as err:
        if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{address} answers but serves no {service}: it is not a {role_name} worker; "
                "fix the registration's --role or --worker",
            ) from None
        if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the router cannot reach {role_name} worker {address} ({err.code().name} within "
                f"{timeout:g}s: {err.details()}); {ADVICE}",
            ) from None
        # any other answer came from a gRPC server with a health service there: reachable
    if not check_kv:
        return
    try:
        load = await worker_pb2_grpc.PrefillWorkerStub(channel).GetLoad(
            worker_pb2.GetLoadRequest(), timeout=timeout
        )
    except grpc.aio.AioRpcError:
        return  # reachable a moment ago; the probes sort out the rest
    kv = load.kv_address
    if kv.port:
        why = await tcp_unreachable(kv.host, kv.port, timeout)
        if why:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                kv_unreachable_message(address, f"{kv.host}:{kv.port}", why),
            )
