"""The HTTP front with API keys: 401 in OpenAI's shape (also for the official client), /metrics
for admin keys only, /health open, and a per-caller rate limit answered 429 with Retry-After.
A router process of its own, in front of the session's workers."""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from helpers_procs import free_port

from splitserve.service.credentials import bearer


def _call(url: str, key: str | None = None, body: Any = None) -> tuple[int, Any, dict[str, str]]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, raw, got = resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        status, raw, got = err.code, err.read(), dict(err.headers)
    try:
        return status, json.loads(raw), got
    except ValueError:
        return status, raw.decode(), got


@pytest.fixture(scope="module")
def keyed(stack, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    keys = {name: secrets.token_urlsafe(24) for name in ("a", "b", "admin")}
    (folder / "api").write_text(f"{keys['a']}\n{keys['b']}\n")
    (folder / "admin").write_text(keys["admin"])
    (folder / "router.yaml").write_text(
        "auth: {rate_per_s: 0.02, burst: 2}\n"  # two requests per caller, then 429
    )
    http_port = free_port()
    router = stack.procs.router(
        stack.model,
        "--config",
        str(folder / "router.yaml"),
        "--prefill",
        stack.prefill,
        "--decode",
        stack.decode,
        "--http-port",
        str(http_port),
        "--model-name",
        "tiny",
        "--api-keys-file",
        str(folder / "api"),
        "--admin-keys-file",
        str(folder / "admin"),
        name="keyed-router",
    )
    yield f"http://127.0.0.1:{http_port}", keys
    assert router.stop() == 0, router.log()
    assert "Traceback" not in router.log() and keys["a"] not in router.log(), router.log()


def test_requests_without_a_valid_key_get_401_in_openai_shape(stack, keyed):
    base, keys = keyed
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}
    missing = _call(base + "/v1/completions", None, body)
    wrong = _call(base + "/v1/models", secrets.token_urlsafe(24))
    health = _call(base + "/health")
    ok = _call(base + "/v1/completions", keys["a"], body)
    client = openai.OpenAI(base_url=base + "/v1", api_key="not-a-key-of-this-router", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    stack.assert_free()
    for status, err, _ in (missing, wrong):
        assert status == 401 and err["error"]["code"] == "invalid_api_key", err
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    assert "required" in missing[1]["error"]["message"]
    assert refused.value.status_code == 401
    assert health[0] == 200
    assert ok[0] == 200 and ok[1]["usage"]["completion_tokens"] == 3


def test_metrics_need_an_admin_key(keyed):
    base, keys = keyed
    plain = _call(base + "/metrics", keys["b"])
    admin = _call(base + "/metrics", keys["admin"])
    assert plain[0] == 403 and "admin key" in plain[1]["error"]["message"]
    assert admin[0] == 200 and "splitserve_router_requests_total" in admin[1]


def test_a_caller_over_its_rate_gets_429_with_retry_after(stack, keyed):
    base, keys = keyed
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    got = [_call(base + "/v1/completions", keys["b"], body) for _ in range(3)]
    # admitted before the body is parsed or a chat template rendered: a bad body is 429 too
    unparsed = _call(base + "/v1/chat/completions", keys["b"], {"messages": "not a list"})
    stack.assert_free()
    assert unparsed[0] == 429, unparsed
    assert [g[0] for g in got[:2]] == [200, 200]
    status, err, headers = got[2]
    assert status == 429 and err["error"]["type"] == "rate_limit_error"
    assert 1 <= int(headers["Retry-After"]) <= 60


def test_bearer_parsing():
    assert bearer("Bearer abc") == "abc" and bearer("bearer  abc ") == "abc"
    assert bearer("Basic abc") is None and bearer("") is None and bearer("Bearer") is None
