"""The client interceptors that carry a bearer token (the router's cluster secret to its workers,
a client's API key to the router) put `authorization: Bearer <token>` on unary-unary *and*
unary-stream calls (Decode and Generate are streams). grpc.aio files an interceptor under the
first call kind it implements only, so one object doing both would leave every stream without
the token: checked on a real grpc.aio server (health Check and Watch)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.cli.api_key import grpc_interceptors
from splitserve.service.cluster_auth import client_interceptors


async def _authorization_seen(interceptors) -> dict[str, list[str]]:
    """method -> the authorization values the server received, for one Check and one Watch."""
    seen: dict[str, list[str]] = {}

    class Record(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            method = details.method.rsplit("/", 1)[1]
            seen[method] = [v for k, v in details.invocation_metadata or () if k == "authorization"]
            return await continuation(details)

    server = grpc.aio.server(interceptors=[Record()])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=interceptors
        ) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
            first = await watch.read()
            watch.cancel()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
    return seen


@pytest.mark.parametrize(
    "interceptors,token",
    [
        (client_interceptors(b"cluster-secret-0123456789"), "cluster-secret-0123456789"),
        (grpc_interceptors("api-key-0123456789abcdef"), "api-key-0123456789abcdef"),
    ],
    ids=["cluster-secret", "api-key"],
)
def test_token_goes_with_unary_and_streaming_calls(interceptors, token):
    seen = asyncio.run(_authorization_seen(interceptors))
    assert seen == {"Check": [f"Bearer {token}"], "Watch": [f"Bearer {token}"]}


def test_no_token_no_interceptor():
    assert client_interceptors(None) is None and grpc_interceptors(None) is None
