"""The /metrics endpoint against strangers (service/metrics_http.py): a client that never sends
its whole request, or dribbles it, is cut off at the read deadline, connections beyond a
client's cap are closed at accept (no thread held), and scrapes keep working throughout."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from splitserve.service import metrics_http


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        return resp.read().decode()


def _slow_clients(port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):  # a request line never finished
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /metr")
        out.append(s)
    return out


def _closed_by_server(s: socket.socket, wait_s: float) -> bool:
    s.settimeout(wait_s)
    try:
        while s.recv(4096):
            pass
        return True
    except TimeoutError:
        return False


@pytest.fixture
def serve(monkeypatch):
    started = []

    def start(per_client: int, deadline_s: float) -> int:
        monkeypatch.setattr(metrics_http, "PER_CLIENT", per_client)
        monkeypatch.setattr(metrics_http, "READ_DEADLINE_S", deadline_s)
        registry = CollectorRegistry()
        Counter("probe_total", "a counter", registry=registry).inc()
        httpd, _ = metrics_http.start_metrics_server(0, "127.0.0.1", registry)
        started.append(httpd)
        return httpd.server_port

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def test_connections_beyond_a_clients_cap_are_closed_at_accept(serve):
    port = serve(4, 600.0)
    clients = _slow_clients(port, 10)
    try:
        # accepted in order: the first 4 hold the slots (the server waits for their request)
        assert [_closed_by_server(s, 30) for s in clients[4:]] == [True] * 6
        assert [_closed_by_server(s, 0.3) for s in clients[:4]] == [False] * 4
        clients[0].close()  # a slot comes back
    finally:
        for s in clients:
            s.close()


def test_a_request_that_never_completes_is_cut_off_even_when_dribbled(serve):
    port = serve(8, 1.0)
    clients = _slow_clients(port, 3)
    dribbler = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        assert [_closed_by_server(s, 30) for s in clients] == [True] * 3
        # a byte every 0.2 s: each read succeeds, the deadline still ends it
        dribbler.settimeout(0.2)
        cut = False
        for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 300:
            try:
                dribbler.sendall(bytes([byte]))
                if dribbler.recv(4096) == b"":
                    cut = True
                    break
            except TimeoutError:
                continue
            except OSError:  # reset by the server's shutdown
                cut = True
                break
        assert cut
        assert "probe_total 1.0" in _scrape(port)
    finally:
        for s in (*clients, dribbler):
            s.close()
