"""The shared grpc.aio server: health follows warm-up and drain, a taken port is a clear error."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.service.grpc_service import GrpcServer, ServerConfig, channel_options

Status = health_pb2.HealthCheckResponse


def test_health_not_serving_until_ready_and_while_draining():
    async def body():
        server = GrpcServer(ServerConfig(port=0))
        await server.start()
        async with grpc.aio.insecure_channel(server.address, options=channel_options()) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert (
                await health.Check(health_pb2.HealthCheckRequest())
            ).status == Status.NOT_SERVING
            await server.set_serving(True)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == Status.SERVING
            watch = health.Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == Status.SERVING
            drain = asyncio.ensure_future(
                server.drain(grace_s=1.0)
            )  # the watch is an in-flight call
            assert (await watch.read()).status == Status.NOT_SERVING
            await server.set_serving(True)  # ignored once draining
            await drain
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await server.drain()  # idempotent

    asyncio.run(body())


def test_taken_port_is_a_one_line_error():
    async def body():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            server = GrpcServer(ServerConfig(port=taken.getsockname()[1]))
            with pytest.raises(
                RuntimeError, match=r"cannot listen on 127\.0\.0\.1:\d+: .*pick another --port"
            ):
                await server.start()
            await server.drain(0)

    asyncio.run(body())
