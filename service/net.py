"""This machine's address as peers on other machines dial it.

A service bound to every interface (0.0.0.0, ::) must still advertise one concrete address:
the router dials it, and a prefill worker writes it into every KvHandle for the decode
workers' UCX connect. The host name is no good (often unresolvable from peers, or resolving
to 127.0.1.1), and 0.0.0.0 is no address at all. So we take the source address of the
default route, else (hosts and namespaces without a default route) the first non-loopback
IPv4 address of an interface that is up; loopback only when nothing else exists.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import socket
import struct

log = logging.getLogger(__name__)

WILDCARDS = frozenset({"0.0.0.0", "::", "[::]", ""})
_SIOCGIFFLAGS, _SIOCGIFADDR = 0x8913, 0x8915
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def local_dial_host(host: str) -> str:
    """The host a process on this machine dials to reach a service bound to `host` (loopback
    for a service bound to every interface)."""
    return "127.0.0.1" if is_wildcard(host) else host


def default_route_ipv4() -> str | None:
    """Source address the kernel picks for an off-host destination (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: normally reached through the default route
            ip = s.getsockname()[0]
    except OSError:  # ENETUNREACH: no default route
        return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def interface_ipv4s() -> list[str]:
    """IPv4 addresses of the interfaces that are up and not loopback, in interface order."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)[16:18])[0]
                if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                    continue
                found.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24]))
            except OSError:  # no IPv4 address on this interface
                continue
    return found


@functools.cache
def routable_host() -> str:
    """The address to advertise when bound to every interface (cached for the process)."""
    ip = default_route_ipv4() or next(iter(interface_ipv4s()), None)
    if ip is None:
        log.warning(
            "no non-loopback IPv4 address found: advertising 127.0.0.1, which only this machine can "
            "dial; set --advertise-host to an address peers can reach"
        )
        return "127.0.0.1"
    return ip


def advertised_host(bind_host: str, advertise_host: str | None) -> str:
    """advertise_host when given; else the bound address, or routable_host() for a wildcard bind."""
    if advertise_host:
        return advertise_host
    return routable_host() if is_wildcard(bind_host) else bind_host


# Ports handed to child services: below the kernel's ephemeral range, so that no outgoing
# connection's source port (the router redialling a killed worker, UCX's TCP data sockets) and
# no port-0 bind can take a port between the pick and the child's bind, or while the child is
# restarted on it (the soak's restart flake: the OS gave a redial the very port being reused).
_PICK_LOW = 20000
_PICK_TRIES = 200


def ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the ephemeral range when that leaves room (random
    pick + a bind check); else the OS's pick."""
    import random

    low, high = ephemeral_range()
    lo, hi = (_PICK_LOW, low - 1) if low - _PICK_LOW > 1000 else (high + 1, 65535)
    bind_host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    for _ in range(_PICK_TRIES if hi - lo > 1000 else 0):
        port = random.randint(lo, hi)
        with socket.socket(family) as s:
            try:
                s.bind((bind_host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as s:
        s.bind((bind_host, 0))
        return s.getsockname()[1]
