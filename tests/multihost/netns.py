"""Several "hosts" on one machine: Linux network namespaces joined by a bridge.

    ss-br-XXXX    (namespace holding bridge br0; nothing else runs there)
       ├─ p-router  ══veth══ eth0 198.18.0.1/24   ss-router-XXXX
       ├─ p-prefill ══veth══ eth0 198.18.0.2/24   ss-prefill-XXXX
       └─ p-decode  ══veth══ eth0 198.18.0.3/24   ss-decode-XXXX

Addresses come from 198.18.0.0/15 (reserved for network tests); each host has loopback up
and no default route, so a service that advertises 127.0.0.1, 0.0.0.0 or a host name is
unreachable from its peers, as between real machines. `link(host, up)` switches the
bridge-side end of a host's cable: the host keeps its address and sees carrier loss, its
peers see silence (no RST), as with a pulled cable or a dead switch port.

Needs root and iproute2; `unavailable()` says why not, for a skip. Every name carries a
random suffix, so concurrent runs never collide; `destroy()` is idempotent.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence

HOSTS = {"router": "198.18.0.1", "prefill": "198.18.0.2", "decode": "198.18.0.3"}
PREFIX_LEN = 24


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if shutil.which("ip") is None:
        return "no `ip` binary (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"ss-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        for args in (
            ("link", "add", "br0", "type", "bridge"),
            ("link", "add", "va", "type", "veth", "peer", "vb"),
        ):
            done = _ip("-n", probe, *args, check=False)
            if done.returncode != 0:
                return f"cannot create a {args[-1] if args[-1] == 'bridge' else 'veth'} link: {done.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class Topology:
    def __init__(self) -> None:
        suffix = secrets.token_hex(3)
        self.bridge_ns = f"ss-br-{suffix}"
        self.ns = {host: f"ss-{host}-{suffix}" for host in HOSTS}
        self.ip = dict(HOSTS)
        self._made: list[str] = []

    def create(self) -> Topology:
        _ip("netns", "add", self.bridge_ns)
        self._made.append(self.bridge_ns)
        br = ("-n", self.bridge_ns)
        _ip(*br, "link", "add", "br0", "type", "bridge")
        _ip(*br, "link", "set", "br0", "up")
        for host, ns in self.ns.items():
            _ip("netns", "add", ns)
            self._made.append(ns)
            # created in the bridge namespace, the host end moved (and renamed) into the host's
            _ip(
                *br, "link", "add", f"p-{host}", "type", "veth", "peer", "name", "eth0", "netns", ns
            )
            _ip(*br, "link", "set", f"p-{host}", "master", "br0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.ip[host]}/{PREFIX_LEN}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        return self

    def link(self, host: str, up: bool) -> None:
        """Plugs (up) or pulls (down) the host's cable at the bridge."""
        _ip("-n", self.bridge_ns, "link", "set", f"p-{host}", "up" if up else "down")

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """argv run inside `host`'s network namespace."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def destroy(self) -> None:
        """Deletes every namespace made (their veths and the bridge go with them)."""
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)


class Driver:
    """Talks to netns_driver.py running inside a namespace (JSON lines, see there)."""

    def __init__(self, argv: list[str], log_path) -> None:
        self._log = open(log_path, "w")  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            process_group=0,
        )
        self._queues: dict[int | None, queue.Queue] = {}
        self._lock = threading.Lock()
        self._next = 0
        threading.Thread(target=self._read, daemon=True).start()
        self.replies(None).get(timeout=60)  # {"event": "ready"}

    def replies(self, tag):
        with self._lock:
            return self._queues.setdefault(tag, queue.Queue())

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            msg["at"] = time.monotonic()  # when it arrived: tests time events that they read later
            self.replies(msg.pop("tag")).put(msg)

    def send(self, op: str, **kw):
        """Starts a command; returns the queue its replies arrive on."""
        with self._lock:
            self._next += 1
            tag = self._next
        q = self.replies(tag)
        self.proc.stdin.write(json.dumps({"op": op, "tag": tag, **kw}) + "\n")
        self.proc.stdin.flush()
        return q

    def call(self, op: str, timeout: float = 15.0, check: bool = True, **kw) -> dict:
        msg = self.send(op, **kw).get(timeout=timeout)
        if check and "error" in msg and op != "load":
            raise AssertionError(f"driver {op} failed: {msg['error']}")
        return msg

    def close(self) -> None:
        """Kills the driver (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self._log):
            with contextlib.suppress(OSError):
                f.close()
