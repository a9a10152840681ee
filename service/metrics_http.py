"""A service's Prometheus /metrics endpoint: prometheus_client's WSGI app on its threaded server,
with what that server lacks against a stranger on the port (it kept a thread per slow client
forever: 300 idle connections, 320 threads):

    READ_DEADLINE_S   a connection whose request (line and headers) is not in this long after
                      accept is shut down, however slowly it dribbles bytes (a reaper thread)
    PER_CLIENT        connections served at once per client address; beyond it, closed at
                      accept, so one stranger cannot take the slots a scraper needs
    MAX_CONNECTIONS   connections served at once in all
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

READ_DEADLINE_S = 10.0
PER_CLIENT = 8
MAX_CONNECTIONS = 128
log = logging.getLogger("splitserve.metrics")


class _Handler(WSGIRequestHandler):
    timeout = READ_DEADLINE_S  # no single read waits longer than the whole request may take

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.request_read(self.request)  # headers in: the deadline no longer applies
        return ok

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        """Scrapes are not logged."""


class _BoundedServer(ThreadingWSGIServer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._clients: Counter[str] = Counter()
        self._reading: dict[socket.socket, float] = {}  # socket -> deadline
        self._closed = threading.Event()
        threading.Thread(target=self._reap, name="metrics-reaper", daemon=True).start()

    def process_request(self, request, client_address) -> None:
        host = client_address[0]
        with self._lock:
            full = (
                self._clients[host] >= PER_CLIENT or sum(self._clients.values()) >= MAX_CONNECTIONS
            )
            if not full:
                self._clients[host] += 1
                self._reading[request] = time.monotonic() + READ_DEADLINE_S
        if full:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request, host)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request, client_address[0])

    def request_read(self, request) -> None:
        with self._lock:
            self._reading.pop(request, None)

    def _done(self, request, host: str) -> None:
        with self._lock:
            self._reading.pop(request, None)
            self._clients[host] -= 1
            if self._clients[host] <= 0:
                del self._clients[host]

    def _reap(self) -> None:
        while not self._closed.wait(0.5):
            now = time.monotonic()
            with self._lock:
                late = [s for s, deadline in self._reading.items() if deadline <= now]
            for s in late:  # its blocked read returns: the handler thread ends
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics request from %s failed", client_address[0], exc_info=True)

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()


def start_metrics_server(
    port: int, addr: str, registry: CollectorRegistry
) -> tuple[WSGIServer, threading.Thread]:
    """Serves `registry` on addr:port in a daemon thread; OSError when the port cannot be bound."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server_class = type("MetricsServer", (_BoundedServer,), {"address_family": family})
    httpd = make_server(
        sockaddr[0], port, make_wsgi_app(registry), server_class, handler_class=_Handler
    )
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """start_metrics_server, with a port that cannot be bound as one RuntimeError line."""
    try:
        return start_metrics_server(port, host, registry)[0]
    except OSError as exc:
        raise RuntimeError(
            f"cannot serve metrics on {host}:{port} ({exc}); pick another --metrics-port"
        ) from None
