"""Credential fuzzing of the workers and of every service's health (fuzz_auth_support.py has the
set-up): the workers' RPCs with random metadata and bodies get UNAUTHENTICATED, the secret never
echoed; health Check and Watch with random service names and metadata on the router and both
workers stay open (NOT_FOUND / SERVICE_UNKNOWN for unknown names). After every test: every
service SERVING, every KV block free, the oracle's tokens, no traceback, no key in any log."""

from __future__ import annotations

import fuzz_support as fz
import grpc
from fuzz_auth_support import (
    ASCII,
    EXTRA_MD,
    KEY_CHARS,
    SERVICES,
    WATCH,
    H,
    _no_echo,
    _settings,
)
from fuzz_messages import random_message
from fuzz_support import C, _call
from grpc_health.v1 import health_pb2
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_workers import DECODE_RPCS, PREFILL_RPCS

WORKER_CALLS = [("prefill", f"/{fz.PREFILL_SERVICE}/{r}", c) for r, (c, _) in PREFILL_RPCS.items()]
WORKER_CALLS += [("decode", f"/{fz.DECODE_SERVICE}/{r}", c) for r, (c, _) in DECODE_RPCS.items()]


def test_workers_refuse_fuzzed_metadata(g, ended):
    s = g.secret
    forged = [f"Bearer {t}" for t in (s[:-1], s + "x", "x" + s, s.swapcase(), g.key, g.admin)]
    forged += ["", "Bearer", s, f"Basic {s}", f"Bearer{s}", f"Bearer:{s}", f"{s} Bearer"]
    values = (
        st.sampled_from(forged)
        | st.text(ASCII, max_size=60)
        | st.text(KEY_CHARS, min_size=16).map(lambda t: f"Bearer {t}")
    )
    metadata = st.tuples(
        st.lists(values.map(lambda v: ("authorization", v)), max_size=2),
        EXTRA_MD,
        st.sampled_from([[], [("authorization-bin", f"Bearer {s}".encode())]]),
    ).map(lambda parts: [p for part in parts for p in part])
    calls = st.sampled_from(WORKER_CALLS).flatmap(
        lambda c: st.tuples(st.just(c), random_message(c[2]) | st.binary(max_size=80))
    )

    @_settings(60)
    @given(calls, metadata)
    def check(call, md) -> None:
        (role, method, _), msg = call
        raw = msg if isinstance(msg, bytes) else msg.SerializeToString()
        with grpc.insecure_channel(getattr(g, role).address) as ch:
            out = _call(ch, method, raw, method.endswith("/Decode"), md)
            probe = _call(ch, fz.HEALTH_CHECK, b"", metadata=md)
        assert out.code == C.UNAUTHENTICATED and "cluster secret" in out.details, (method, md, out)
        _no_echo(out.details, g, [v for _, v in md if isinstance(v, str)])
        assert probe.code == C.OK, ("worker health needs no secret", probe)

    check()
    with grpc.insecure_channel(g.prefill.address) as ch:  # the secret itself is let through
        md = [("authorization", f"Bearer {s}")]
        assert _call(ch, f"/{fz.PREFILL_SERVICE}/GetLoad", b"", metadata=md).code == C.OK


def test_health_check_and_watch_take_random_service_names(g, ended):
    own = {p.address: service for p, service in zip(g.procs, SERVICES)}
    names = (
        st.sampled_from(["", *SERVICES])
        | st.text(max_size=30).map(lambda n: "x" + n)
        | st.sampled_from(["x" * 70_000, "é\x00😀", "x/../y", " ", fz.ROUTER_SERVICE + " "])
    )
    junk = st.lists(st.tuples(st.just("authorization"), st.text(ASCII, max_size=40)), max_size=1)

    @_settings(40)
    @given(st.sampled_from(sorted(own)), names, junk)
    def check(address, name, md) -> None:
        known = name in ("", own[address])
        raw = health_pb2.HealthCheckRequest(service=name).SerializeToString()
        with grpc.insecure_channel(address) as ch:
            out = _call(ch, fz.HEALTH_CHECK, raw, metadata=md)
            watch = ch.unary_stream(WATCH)(raw, metadata=md, timeout=10)
            try:
                first = H.FromString(next(watch))  # a hang is DEADLINE_EXCEEDED after 10 s
            finally:
                watch.cancel()
        if known:
            assert out.code == C.OK and H.FromString(out.replies[0]).status == H.SERVING, out
        else:
            assert out.code == C.NOT_FOUND, (address, name[:40], out)
        assert first.status == (H.SERVING if known else H.SERVICE_UNKNOWN), (address, name[:40])

    check()


def test_a_strangers_big_message_is_refused_without_being_read(g, ended):
    """The refusal takes no message (service/cluster_auth.py): 20 MiB of garbage without the
    secret is UNAUTHENTICATED, not INVALID_ARGUMENT from a parse or RESOURCE_EXHAUSTED."""
    raw = b"\x0a" + b"\xff" * (20 * 2**20)
    for role, method, _ in (WORKER_CALLS[0], WORKER_CALLS[-1]):
        with grpc.insecure_channel(getattr(g, role).address) as ch:
            out = _call(ch, method, raw, method.endswith("/Decode"))
        assert out.code == C.UNAUTHENTICATED and "cluster secret" in out.details, (method, out)
