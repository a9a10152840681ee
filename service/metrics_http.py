"""A service's Prometheus /metrics endpoint: prometheus_client's WSGI app on its threaded server,
with what that server lacks against a stranger on the port: a connection whose request does not
arrive within READ_TIMEOUT_S is closed (slow-header clients each held a thread forever: 300 idle
connections, 320 threads), and at most MAX_CONNECTIONS are served at once (the rest are closed at
accept).
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32


class _Handler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # socket timeout for every read and write of the request

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        """Scrapes are not logged."""


def _server_class(family: int) -> type[WSGIServer]:
    class BoundedServer(ThreadingWSGIServer):
        address_family = family

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        def process_request(self, request, client_address) -> None:
            if not self._slots.acquire(blocking=False):  # full: refuse, keep no thread
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self._slots.release()
                raise

        def process_request_thread(self, request, client_address) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                self._slots.release()

    return BoundedServer


def start_metrics_server(
    port: int, addr: str, registry: CollectorRegistry
) -> tuple[WSGIServer, threading.Thread]:
    """Serves `registry` on addr:port in a daemon thread; OSError when the port cannot be bound."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    httpd = make_server(
        sockaddr[0], port, make_wsgi_app(registry), _server_class(family), handler_class=_Handler
    )
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread
