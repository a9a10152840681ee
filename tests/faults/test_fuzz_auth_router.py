"""Fuzzing credentials at the router (issue 34; the workers' side and health are in
test_fuzz_auth_workers.py, the shared set-up in fuzz_auth_support.py): a router WITH two API keys
and an admin key, in front of workers that REQUIRE the cluster secret. Authorization values are
random, mutated and hand-picked: none, empty, a bare scheme, wrong / mangled / right / admin keys
with odd spacing and case, other schemes, non-ASCII bytes (HTTP), ~10 KB, several at once.

  * router gRPC (Generate, Abort, GetServerInfo, health) and HTTP (/v1/completions, /v1/chat/
    completions, /v1/models, /metrics, /health): UNAUTHENTICATED / 401 in OpenAI's shape without
    a known key, success with one; worker addresses and /metrics for admin keys only (a plain
    key: addresses blank, 403); a refusal never echoes what was presented nor any key;
  * Abort with fuzzed credentials never finds another caller's running request;
  * the workers' RPCs with random metadata and bodies: UNAUTHENTICATED, the secret never echoed;
  * health Check and Watch (first message, then cancel), random service names and metadata, on
    the router and both workers: open to all, NOT_FOUND / SERVICE_UNKNOWN for unknown names.
gRPC's metadata limit (8 KB soft, 16 KB hard) may answer RESOURCE_EXHAUSTED; aiohttp's parser
answers a header over 8190 bytes or with a control character 400 itself (its plain-text body
quotes the line's first bytes back to the sender; the router's log must not). After every test:
every service SERVING, every KV block free, the oracle's tokens through the router, no traceback
and no key or secret in any log."""

from __future__ import annotations

import asyncio
import json

import fuzz_support as fz
import grpc
from fault_helpers import SLOW_PULL, leases_held
from fuzz_auth_support import (
    ADMIN,
    BIG,
    EXTRA_MD,
    PLAIN,
    PROMPT,
    REFUSED,
    RPC,
    Pairs,
    _no_echo,
    _settings,
    credentials,
)
from fuzz_support import C, _call, _http
from hypothesis import given
from hypothesis import strategies as st
from router_helpers import greedy, ids_request

from splitserve.protos import generate_pb2, generate_pb2_grpc


def test_router_grpc_credentials(g, ended):
    def answer(values, extra) -> str:
        md = [("authorization", v) for v in values] + extra
        big = sum(len(k) + len(v) for k, v in md) > 8000  # gRPC's soft metadata limit
        gen = ids_request(PROMPT, greedy(2, ignore_eos=True)).SerializeToString()
        abort = generate_pb2.AbortRequest(request_id=fz.fresh_id("auth")).SerializeToString()
        with grpc.insecure_channel(g.router.address) as ch:
            outs = {
                "info": _call(ch, RPC + "GetServerInfo", b"", metadata=md),
                "gen": _call(ch, RPC + "Generate", gen, True, md),
                "abort": _call(ch, RPC + "Abort", abort, metadata=md),
                "health": _call(ch, fz.HEALTH_CHECK, b"", metadata=md),
            }
        if big:  # refused by gRPC itself, or not
            outs = {k: o for k, o in outs.items() if o.code != C.RESOURCE_EXHAUSTED}
        if "health" in outs:
            assert outs.pop("health").code == C.OK, "health needs no key"
        if not outs:
            return BIG
        if any(o.code == C.UNAUTHENTICATED for o in outs.values()):
            for o in outs.values():
                assert o.code == C.UNAUTHENTICATED and "API key" in o.details, o
                _no_echo(o.details, g, values)
            return REFUSED
        assert all(o.code == C.OK for o in outs.values()), outs
        if "gen" in outs:
            chunks = map(generate_pb2.GenerateResponse.FromString, outs["gen"].replies)
            assert sum(len(c.token_ids) for c in chunks) == 2, outs["gen"]
        if "abort" in outs:
            assert not generate_pb2.AbortResponse.FromString(outs["abort"].replies[0]).found
        if "info" not in outs:
            return BIG
        info = generate_pb2.ServerInfo.FromString(outs["info"].replies[0])
        workers = sorted(w.address for w in info.workers)
        assert workers in (["", ""], sorted([g.prefill.address, g.decode.address])), workers
        return ADMIN if workers[0] else PLAIN  # worker addresses for admins only

    seen = set()

    @_settings(40)
    @given(credentials(g, http=False), EXTRA_MD)
    def check(case, extra) -> None:
        values, allowed = case
        got = answer(values, extra)
        assert got in allowed or got == BIG, (values, extra, got, allowed)
        seen.add(got)

    check()
    assert {REFUSED, PLAIN, ADMIN} <= seen, seen  # each answer came up


CHAT = [{"role": "user", "content": "hi"}]
HTTP_CALLS = [
    ("POST", "/v1/completions", {"model": fz.MODEL, "prompt": "hello", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": fz.MODEL, "messages": CHAT, "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/health", None),
]


def test_router_http_credentials(g, ended):
    def answer(name, values) -> str:
        headers = Pairs((name, v) for v in values)
        status, _, body = _http(g, "GET", "/metrics", None, headers, timeout=30)
        if status == 400 and not body.startswith(b"{"):  # aiohttp's parser refused a header
            odd = [v for v in values if len(v) > 8000 or isinstance(v, bytes) and b"\x01" in v]
            assert odd, (values, body[:300])
            return BIG
        got = {200: ADMIN, 403: PLAIN, 401: REFUSED}.get(status)
        assert got is not None, (status, body[:300])
        if status != 200:
            e = fz._error_shape(status, body, values)
            assert e["code"] == ("invalid_api_key" if got == REFUSED else "permission_denied"), e
            _no_echo(e["message"], g, values)
        for method, path, sent in HTTP_CALLS:
            raw = None if sent is None else json.dumps(sent).encode()
            status, got_headers, body = _http(g, method, path, raw, headers, timeout=30)
            fz._check_http(status, got_headers, body, method, path, sent)
            if got == REFUSED and path != "/health":  # probes stay open
                assert status == 401, (path, status, body[:300])
                e = fz._error_shape(status, body, path)
                assert e["code"] == "invalid_api_key", e
                _no_echo(e["message"], g, values)
            else:
                assert status == 200, (path, status, body[:300])
        return got

    seen = set()

    @_settings(30)
    @given(
        st.sampled_from(["Authorization", "authorization", "AUTHORIZATION"]), credentials(g, True)
    )
    def check(name, case) -> None:
        values, allowed = case
        got = answer(name, values)
        assert got in allowed or got == BIG, (values, got, allowed)
        seen.add(got)

    check()
    assert {REFUSED, PLAIN, ADMIN, BIG} <= seen, seen


def test_fuzzed_credentials_cannot_abort_another_callers_request(g, ended):
    """A request of `key` waits 4 s for its KV pull; an Abort of its id with any credential but
    `key` and the admin key is refused or finds nothing; then `key` finds and aborts it."""
    rid = fz.fresh_id(SLOW_PULL)
    mine = (("authorization", f"Bearer {g.key}"),)
    with grpc.insecure_channel(g.router.address) as ch:
        stub = generate_pb2_grpc.GenerateServiceStub(ch)
        call = stub.Generate(ids_request(PROMPT, greedy(8), rid), metadata=mine, timeout=60)
        first = next(call)  # prefilled: live until its pull, 4 s from now
        assert asyncio.run(leases_held(g.prefill.address)) == 1

        @_settings(25)
        @given(credentials(g, False, [(g.other, PLAIN)]), st.sampled_from([rid, rid + "#0"]))
        def check(case, target) -> None:
            raw = generate_pb2.AbortRequest(request_id=target).SerializeToString()
            out = _call(ch, RPC + "Abort", raw, metadata=[("authorization", v) for v in case[0]])
            assert out.code in (C.OK, C.UNAUTHENTICATED, C.RESOURCE_EXHAUSTED), out
            if out.code == C.OK:
                assert not generate_pb2.AbortResponse.FromString(out.replies[0]).found, case

        check()
        found = stub.Abort(generate_pb2.AbortRequest(request_id=rid), metadata=mine, timeout=30)
        rest = list(call)
    assert first.request_id == rid and found.found
    assert rest[-1].finish_reason == generate_pb2.FINISH_REASON_ABORT, rest[-1:]


def test_a_message_far_over_the_request_limit_is_refused_before_it_is_read(g, ended):
    """The public port takes at most max_request_bytes (8 MiB) + 2 MiB: a stranger's 10 MiB is
    RESOURCE_EXHAUSTED from gRPC itself, with or without a key, before any handler parses it;
    just over the limit, a keyed request gets the router's own message (the limit, the fix)."""
    method = f"{RPC}Generate"
    keyed = [("authorization", f"Bearer {g.key}")]
    with grpc.insecure_channel(g.router.address) as ch:
        for md in (None, keyed):
            out = _call(ch, method, b"\x0a" + b"\xff" * (10 * 2**20), True, md)
            assert out.code == C.RESOURCE_EXHAUSTED and "larger than max" in out.details, out
        over = generate_pb2.GenerateRequest(request_id="big", text="a" * (8 * 2**20 + 4096))
        out = _call(ch, method, over.SerializeToString(), True, keyed)
        assert out.code == C.INVALID_ARGUMENT and "max_request_bytes" in out.details, out
