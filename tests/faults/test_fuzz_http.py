"""Fuzzing the OpenAI HTTP front: random bytes, random JSON (lone surrogates included), mutated-valid
completion / chat bodies, odd headers, every route, unknown paths and methods, and requests the
HTTP parser refuses: 2xx or a 4xx in OpenAI's error shape, never a 500 (fuzz_support.py)."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from fuzz_support import (
    MODEL,
    _check_http,
    _end,
    _http,
    fuzz_settings,
)
from hypothesis import given
from hypothesis import strategies as st
from router_helpers import MAX_MODEL_LEN
from test_bad_input import VOCAB

SURROGATE = st.integers(0xD800, 0xDFFF).map(chr)
JSON_TEXT = st.text(st.characters() | SURROGATE, max_size=16)
JSON_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**32 - 1, 2**32, 2**64, -(2**63), 10**400])
    | st.floats()
    | JSON_TEXT,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(JSON_TEXT, kids, max_size=4),
    max_leaves=12,
)


def _deep(depth: int, leaf: Any = 1) -> str:
    return "[" * depth + json.dumps(leaf) + "]" * depth


HAND_BODIES = [  # what random generation rarely builds
    b"",
    b"null",
    b"[" * 100_000,
    _deep(100_000).encode(),
    json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode("utf-16"),
    b'{"prompt": "\\ud800", "max_tokens": 2}',
    b'{"prompt": "ok", "max_tokens": 2, "stop": ["\\udfff"]}',
    b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
    b'{"prompt": "a", "max_tokens": 2, "temperature": NaN}',
    b'{"prompt": "a", "max_tokens": 2, "top_p": -Infinity}',
    b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"5": Infinity}}',
    b'{"prompt": "a", "max_tokens": 2, "prompt": "twice"}',
    b'{"prompt": "a", "max_tokens": 1e400}',
    b'{"prompt": "a", "max_tokens": 2}' + b" " * 100 + b"trailing",
    b'\xef\xbb\xbf{"prompt": "a", "max_tokens": 2}',
    b'{"prompt": "a\x00b", "max_tokens": 2}',
    b'{"prompt": "\xff\xfe", "max_tokens": 2}',
]
for _field in ("prompt", "stop", "user", "logit_bias", "messages", "stream_options", "model"):
    HAND_BODIES.append(('{"max_tokens": 2, "%s": %s}' % (_field, _deep(900))).encode())  # noqa: UP031


HEADER_BYTES = [*range(0x20, 0x7F), *range(0x80, 0x100)]  # what HTTP lets a header value hold


def _header_value() -> st.SearchStrategy:
    return st.one_of(
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
        st.lists(st.sampled_from(HEADER_BYTES), max_size=12).map(bytes),
        st.sampled_from([b"\xff\xfe", "é".encode(), b"Bearer \xff", "x" * 300, "a#b c"]),
    )


HEADERS = st.dictionaries(
    st.sampled_from(["X-Request-Id", "Authorization", "Content-Type", "Accept"]),
    _header_value(),
    max_size=3,
)
GEN_PATHS = ["/v1/completions", "/v1/chat/completions"]


def test_http_random_bodies_and_headers(front, cluster, oracle, logs):
    bodies = st.one_of(
        st.binary(max_size=200),
        JSON_VALUE.map(lambda v: json.dumps(v).encode()),
        st.sampled_from(HAND_BODIES),
    )

    @fuzz_settings(150)
    @given(st.sampled_from(GEN_PATHS), bodies, HEADERS)
    def check(path, body, headers) -> None:
        status, got_headers, out = _http(front, "POST", path, body, headers)
        _check_http(status, got_headers, out, "POST", path, body[:200])

    check()
    for path in GEN_PATHS:  # every hand-made body on both routes
        for body in HAND_BODIES:
            status, got_headers, out = _http(front, "POST", path, body)
            _check_http(status, got_headers, out, "POST", path, body[:200])
    # header bytes that are no UTF-8 (aiohttp hands them on as surrogate escapes)
    good = json.dumps(BASES["/v1/completions"]).encode()
    for headers in ({"X-Request-Id": b"id-\xff\xfe"}, {"Authorization": b"Bearer \xff\x80"}):
        status, got_headers, out = _http(front, "POST", "/v1/completions", good, headers)
        _check_http(status, got_headers, out, "POST", "/v1/completions", headers)
        assert status in (200, 400), (headers, status, out)
    _end(front, cluster, oracle)


MSG = [{"role": "user", "content": "Hello"}]
BASES = {
    "/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": MODEL, "messages": MSG, "max_completion_tokens": 2},
}
U32, U64 = 2**32 - 1, 2**64 - 1
EDGES: dict[str, list[Any]] = {
    "model": [MODEL, "other", "", None, "\ud800", "x" * 10_000],
    "stream": [True, False, None, 1, "true"],
    "stream_options": [None, {}, {"include_usage": True}, {"include_usage": "yes"}, {"x": 1}],
    "temperature": [0, 2, 2.5, -0.0, 1e-45, 1e39, 3.4028235e38, None, "0", True],
    "top_p": [0, 1e-45, 1, 1.0000001, None, -1],
    "seed": [0, U64, U64 + 1, -1, None, 1.5],
    "stop": [
        "",
        "x",
        [],
        [""],
        ["zz"] * 16,
        ["zz"] * 17,
        ["zz"] * 65,
        "z" * 256,
        "z" * 257,
        [1],
        None,
    ],
    "presence_penalty": [-2, 2, 2.0000002, -2.1, None],
    "frequency_penalty": [-2, 2, -2.0000002, None],
    "n": [1, 2, 0, -1, None, 1.0, "1"],
    "user": ["u", "", "\x00", 5],
    "logit_bias": [
        {},
        {"0": -100, str(VOCAB - 1): 100},
        {str(VOCAB): 1},
        {"-1": 1},
        {"1": 100.0001},
        {"01": 5, "1": 5},
        {" 1": 1},
        {"٣": 1},
        {str(U32 + 1): 1},
        {str(t): 0 for t in range(301)},
        None,
        [],
    ],
    "top_k": [-2, -1, 0, 1, VOCAB - 1, VOCAB, U32, U32 + 1],
    "min_p": [0, 1, 1.5, -0.1],
    "repetition_penalty": [0, 1e-45, 1, 100, -1],
    "min_tokens": [0, 2, 3, U32, U32 + 1, -1],
    "ignore_eos": [True, False, "x"],
    "stop_token_ids": [
        [],
        [0],
        [VOCAB - 1],
        [VOCAB],
        [-1],
        [U32 + 1],
        list(range(64)),
        list(range(65)),
    ],
    "include_stop_str_in_output": [True, False],
    "skip_special_tokens": [True, False],
    "frobnicate": [1, None],
    # completions
    "prompt": [
        "",
        " ",
        "\x00",
        "😀" * 40,
        [0, VOCAB - 1],
        [VOCAB],
        [],
        [[1, 2]],
        [[]],
        ["a", "b"],
        [-1],
        [U32 + 1],
        [1] * (MAX_MODEL_LEN - 1),
        [1] * MAX_MODEL_LEN,
        "Hi " * 5000,
    ],
    "max_tokens": [0, 1, 2, 200, 256, U32, U32 + 1, -1, None, 2.0, "2"],
    "logprobs": [0, 5, 20, 21, -1, None, True, False],
    "echo": [False, True],
    "best_of": [1, 2, None],
    "suffix": [None, "", "x"],
    # chat
    "messages": [
        [],
        [{"role": "system", "content": "x"}],
        [{"role": "tool", "content": "x"}],
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": []}],
        [{"role": "user"}],
        [{"role": "assistant", "content": "x"}],
        [{"role": "developer", "content": "x", "name": "n"}],
        [{"role": "user", "content": "x", "name": 5}],
        [{"role": "user", "content": "x", "extra": 1}],
        [{"role": "user", "content": "Hi " * 5000}],
        [{"role": "user", "content": "x"}] * 50,
        "Hello",
        {"role": "user", "content": "x"},
    ],
    "max_completion_tokens": [0, 1, 2, 200, U32, U32 + 1, -1, None],
    "top_logprobs": [0, 20, 21, -1, None],
    "tools": [None, [], [{"type": "function"}]],
    "tool_choice": [None, "none", "auto", {"type": "function"}],
    "parallel_tool_calls": [True, None, "x"],
    "functions": [None, [], [{}]],
    "function_call": [None, "none", "auto"],
    "response_format": [None, {"type": "text"}, {"type": "json_object"}, {}, "text"],
}
CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
CHAT_ONLY |= {"parallel_tool_calls", "functions", "function_call", "response_format"}
COMPLETION_ONLY = {"prompt", "echo", "best_of", "suffix"}


@st.composite
def mutated_body(draw) -> tuple[str, dict[str, Any]]:
    """A valid completion or chat body with one to three fields set to an edge value, a random
    JSON value, or removed; streamed or not."""
    path = draw(st.sampled_from(GEN_PATHS))
    body = dict(BASES[path])
    body["stream"] = draw(st.booleans())
    skip = COMPLETION_ONLY if path.endswith("chat/completions") else CHAT_ONLY
    if path.endswith("chat/completions"):
        body["logprobs"] = draw(st.sampled_from([False, True, None]))
        if body["logprobs"] is None:
            del body["logprobs"]
    fields = sorted(set(EDGES) - skip)
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        op = draw(st.sampled_from(["edge", "edge", "random", "remove"]))
        if op == "remove":
            # chat without a max generates up to max_model_len (seconds); completions default to 16
            if not (path.endswith("chat/completions") and name.startswith("max_")):
                body.pop(name, None)
        elif op == "random":
            body[name] = draw(JSON_VALUE)
        else:
            body[name] = draw(st.sampled_from(EDGES[name]))
    return path, body


def test_http_mutated_valid_bodies(front, cluster, oracle, logs):
    @fuzz_settings(150)
    @given(mutated_body(), HEADERS.filter(lambda h: "Authorization" not in h) | st.just({}))
    def check(case, headers) -> None:
        path, body = case
        raw = json.dumps(body).encode()
        status, got_headers, out = _http(front, "POST", path, raw, headers)
        _check_http(status, got_headers, out, "POST", path, body)

    check()
    _end(front, cluster, oracle)


ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE"]  # FROB: MALFORMED


def test_http_routes_paths_and_methods(front, cluster, oracle, logs):
    segment = st.text(st.characters() | SURROGATE, max_size=20).map(
        lambda s: urllib.parse.quote(s.encode("utf-8", "surrogatepass"), safe="")
    )
    paths = st.one_of(
        st.sampled_from(ROUTES),
        segment.map(lambda s: "/v1/models/" + s),
        st.sampled_from(
            [f"/v1/models/{MODEL}", "/v1/models/%ff%fe", "/v1/models/a/b", "/v1/models/"]
        ),
        st.lists(segment, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts)),
        st.sampled_from(ROUTES).flatmap(lambda r: segment.map(lambda q: f"{r}?{q}={q}")),
        st.sampled_from(["//v1/models", "/v1/../health", "/%2e%2e/health", "/V1/MODELS"]),
    )

    @fuzz_settings(100)
    @given(st.sampled_from(METHODS), paths, st.none() | st.binary(max_size=30))
    def check(method, path, body) -> None:
        if method in ("POST", "PUT", "PATCH") and body is None:
            body = b"{}"
        status, headers, out = _http(front, method, path, body)
        _check_http(status, headers, out, method, path, body)
        route = path.split("?")[0]
        if method == "GET" and route == f"/v1/models/{MODEL}":
            assert status == 200, (path, out)
        if method == "GET" and route in ("/v1/models", "/health", "/metrics"):
            assert status == 200, (path, status, out[:200])

    check()
    _end(front, cluster, oracle)


MALFORMED = [  # bytes no HTTP client sends: refused by the server's HTTP parser, or cut short
    b"\x00\x01\x02 garbage\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    b"FROB /health HTTP/1.1\r\nHost: x\r\n\r\n",  # a method the HTTP parser does not know
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 20_000 + b"\r\n",
    # a body shorter than its Content-Length, then the client stops sending
    b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt": ',
    b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"mes\r\n',
]


def test_http_malformed_requests_on_the_wire(front, cluster, oracle, logs):
    """A request the HTTP parser refuses gets a 4xx (aiohttp's own plain-text body) or a closed
    connection, a request whose body never arrives whole ends quietly, and the server keeps
    serving; nothing of it is a traceback."""
    import socket

    for raw in MALFORMED:
        with socket.create_connection(("127.0.0.1", front.http_port), timeout=10) as sock:
            try:
                sock.sendall(raw)
                sock.shutdown(socket.SHUT_WR)
                reply = b""
                while chunk := sock.recv(65536):
                    reply += chunk
            except ConnectionResetError:
                reply = b""
        status = reply.split(b" ", 2)[1] if reply.startswith(b"HTTP/1.") else b""
        assert not reply or status.startswith(b"4"), (raw[:80], reply[:300])
        assert _http(front, "GET", "/health")[0] == 200
    _end(front, cluster, oracle)
