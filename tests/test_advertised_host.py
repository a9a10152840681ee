"""What a service advertises: --advertise-host when given; the bound IP; bound to every
interface, this machine's routable IP (never the host name, never 0.0.0.0); loopback only
when bound to loopback. (A host without a default route: tests/multihost.)"""

from __future__ import annotations

import asyncio
import socket

import pytest
from pydantic import ValidationError

from splitserve.service import net
from splitserve.service.grpc_service import GrpcServer, ServerConfig


def test_wildcard_bind_advertises_the_routable_ip():
    routable = net.routable_host()
    assert routable not in ("0.0.0.0", "", socket.gethostname())
    expected = net.default_route_ipv4() or next(iter(net.interface_ipv4s()), "127.0.0.1")
    assert routable == expected
    if net.interface_ipv4s():  # a machine with a network interface never advertises loopback
        assert not routable.startswith("127.")
        socket.inet_aton(routable)
    for host in ("0.0.0.0", "::"):
        assert ServerConfig(host=host).public_host == routable


def test_specific_bind_and_advertise_host():
    assert ServerConfig().public_host == "127.0.0.1"  # loopback bind: loopback
    assert ServerConfig(host="10.1.2.3").public_host == "10.1.2.3"
    assert ServerConfig(host="0.0.0.0", advertise_host="prefill-0").public_host == "prefill-0"
    for bad in ("0.0.0.0", "::"):
        with pytest.raises(ValidationError, match="no address a peer can dial"):
            ServerConfig(host="0.0.0.0", advertise_host=bad)


def test_server_address_brackets_ipv6():
    async def body():
        server = GrpcServer(ServerConfig(advertise_host="::1"))
        await server.start()
        try:
            return server.address, server.port
        finally:
            await server.drain(0)

    address, port = asyncio.run(body())
    assert address == f"[::1]:{port}"
