"""Fuzzing every service's metrics port and the router's control listener at the socket level
(issue 34), on a router process with a control listener in front of the fault suite's workers
(fuzz_control_support.py): the metrics ports (router, prefill, decode) take random HTTP requests
(methods, paths, queries, headers, bodies) and random bytes on the socket (garbage, cut request
lines, huge headers, a TLS or HTTP/2 start, a client gone before the answer), as does the control
listener's socket: never a 5xx (but HTTP's own 505 to a request line that claims HTTP/2), the
connection always ends, and /metrics still answers with parseable metrics. After every test:
every service SERVING, every KV block free, the oracle's tokens through the router, and no
traceback in any log."""

from __future__ import annotations

import http.client
import re
import socket
import struct

from fuzz_control_support import CONTROL
from fuzz_support import fuzz_settings
from helpers_procs import health_status
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import SERVING

# ---- what is sent --------------------------------------------------------------------------------
TOKEN = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_.~%"), max_size=20)
PATHS = st.one_of(
    st.sampled_from(["/metrics", "/", "/favicon.ico", "/metrics/", "//metrics", "/metrics?"]),
    st.sampled_from(["/metrics?name[]=splitserve_kv_blocks_free", "/metrics?name[]=%ff%00"]),
    st.tuples(TOKEN, TOKEN, TOKEN).map(lambda t: f"/{t[0]}?{t[1]}={t[2]}"),
    st.integers(1, 9000).map(lambda n: "/" + "m" * n),
)
HEADERS = st.lists(
    st.sampled_from([
        ("Accept", "application/openmetrics-text; version=1.0.0; charset=utf-8"),
        ("Accept", "text/plain; version=0.0.4"), ("Accept-Encoding", "gzip"),
        ("Accept-Encoding", "br, gzip;q=0"), ("Connection", "keep-alive"), ("Expect", "100-continue"),
        ("Transfer-Encoding", "chunked"), ("Range", "bytes=0-10"), ("Content-Type", "x/\u00e9"),
    ]) | st.tuples(TOKEN.filter(bool), st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)),
    max_size=4,
)  # fmt: skip
METHODS = st.sampled_from(
    ["GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE", "FOO"]
)
RAW = st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=60).map(lambda b: b"GET /metrics HTTP/1.1\r\n" + b),
    st.sampled_from([
        b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n",
        b"GET " + b"/" * 70_000 + b" HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # a TLS ClientHello start
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04\x00\x00\x00\x00\x00",
        b"GET /metrics HTTP/9.9\r\n\r\n", b"\r\n\r\n", b"GET\r\n\r\n",
    ]),
)  # fmt: skip


def _raw(port: int, data: bytes) -> bytes:
    """Sends `data`, closes our side, reads until the server closes (a hang is a timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed first (it answered a prefix already)
            pass
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    return got


def _reset(port: int, data: bytes) -> None:
    """Sends `data` and resets the connection at once, without reading the answer."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    try:
        s.sendall(data)
    except OSError:
        pass
    s.close()


def _scrape(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        text = resp.read().decode()
    finally:
        conn.close()
    assert resp.status == 200
    assert any(f.name.startswith("splitserve_") for f in text_string_to_metric_families(text))


def test_metrics_ports_and_control_socket_take_random_requests_and_bytes(ctl, cluster, ended_ctl):
    front, control = ctl
    ports = {"router": front.metrics, "prefill": cluster.prefill_metrics}
    ports["decode"] = cluster.decode_metrics
    control_port = int(control.rsplit(":", 1)[1])
    statuses, answered = set(), set()

    @fuzz_settings(100)
    @given(st.sampled_from(sorted(ports)), METHODS, PATHS, HEADERS, st.binary(max_size=200))
    def requests(where, method, path, headers, body) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", ports[where], timeout=30)
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for k, v in headers:
                conn.putheader(k, v)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            resp.read()
        except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
            return  # the server may close on a request it refuses before reading it all
        finally:
            conn.close()
        assert resp.status < 500, (where, method, path[:80], headers, resp.status)
        statuses.add(resp.status)

    @fuzz_settings(150)
    @given(st.sampled_from([*sorted(ports), "control"]), RAW, st.integers(0, 5))
    def raw_bytes(where, data, mode) -> None:
        port = control_port if where == "control" else ports[where]
        if mode == 0:  # gone before the answer: the server's write fails, quietly
            _reset(port, data if where == "control" else b"GET /metrics HTTP/1.1\r\n\r\n" + data)
            return
        got = _raw(port, data)
        if where == "control":
            return
        # a status line, or (a request line it could not parse: HTTP/0.9 style) an HTML error page
        found = re.match(rb"HTTP/1\.[01] (\d{3}) ", got) or re.search(rb"Error code: (\d{3})", got)
        if not found:  # nothing to answer (no request line), or an HTTP/0.9 `GET /path`
            line = data.split(b"\n", 1)[0].split()
            assert not got or line[:1] == [b"GET"] and len(line) == 2, (where, data[:80], got[:200])
            return
        status = int(found[1])
        answered.add(status)
        # 505 is HTTP's own answer to a request line that claims HTTP/2 or later (the h2 preface)
        version = b"Invalid HTTP version" in got and status == 505
        assert status < 500 or version, (where, data[:80], got[:300])

    requests()
    raw_bytes()
    assert 200 in statuses and 400 in answered, (statuses, answered)
    for port in ports.values():
        _scrape(port)
    assert health_status(control, CONTROL) == SERVING
