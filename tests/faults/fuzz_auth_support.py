"""The credential fuzzers' shared parts (test_fuzz_auth_router.py, test_fuzz_auth_workers.py):
the package fixture `g` (a router WITH two API keys and an admin key in front of workers that
REQUIRE the cluster secret, per module: SPLITSERVE_CLUSTER_SECRET stays set while they run,
so they must not outlive the module; registered in conftest.py), `ended`
(the checks after every test), and the authorization-value strategies."""

from __future__ import annotations

import asyncio
import base64
import secrets
from types import SimpleNamespace

import fuzz_support as fz
import grpc
import pytest
from fault_helpers import SLOW_PULL, assert_clean, start_worker
from fuzz_support import _http
from grpc_health.v1 import health_pb2
from helpers_procs import ProcessGroup, free_port, health_status
from hypothesis import settings
from hypothesis import strategies as st
from router_helpers import MAX_MODEL_LEN, SERVING

from splitserve.protos import generate_pb2_grpc
from splitserve.service.cluster_auth import bearer_interceptors

REFUSED, PLAIN, ADMIN, BIG = "refused", "plain", "admin", "too big"  # the answers
SERVICES = (fz.ROUTER_SERVICE, fz.PREFILL_SERVICE, fz.DECODE_SERVICE)
RPC = f"/{fz.ROUTER_SERVICE}/"
WATCH = "/grpc.health.v1.Health/Watch"
PROMPT = [1, 44, 45, 46, 200, 201, 202]
KEY_CHARS = st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
ASCII = st.characters(min_codepoint=0x20, max_codepoint=0x7E)  # what gRPC metadata may hold
SCHEMES = ["Bearer", "bearer", "BEARER", "bEaReR"]
H = health_pb2.HealthCheckResponse


def _settings(n: int) -> settings:
    return settings(fz.fuzz_settings(n), derandomize=True)  # the same examples on every run


class Pairs(list):  # (name, value) headers for `_http`, a name as often as it is given
    def items(self):
        return self


@pytest.fixture(scope="module")
def g(tiny_llama, tmp_path_factory):
    """The workers (the decode one holds a request whose id starts with SLOW_PULL 4 s before its
    KV pull) and the router. SPLITSERVE_CLUSTER_SECRET stays set: worker_load sends it."""
    work = tmp_path_factory.mktemp("fuzz_auth")
    keys = {n: f"{n}-{secrets.token_urlsafe(24)}" for n in ("secret", "key", "other", "admin")}
    (work / "api").write_text(f"# plain keys\n{keys['key']}\n{keys['other']}\n")
    (work / "admin").write_text(keys["admin"] + "\n")
    (work / "secret").write_text(keys["secret"])
    with pytest.MonkeyPatch.context() as mp, ProcessGroup(work) as procs:
        mp.setenv("SPLITSERVE_CLUSTER_SECRET", keys["secret"])
        prefill, _ = start_worker(procs, "prefill", tiny_llama, wait=False)
        faults = {"delay_before_pull_s": 4.0, "request_id_prefix": SLOW_PULL}
        decode, _ = start_worker(procs, "decode", tiny_llama, faults, wait=False)
        prefill.wait_serving()
        decode.wait_serving()
        http_port = free_port()
        router = procs.router(
            tiny_llama,
            *("--prefill", prefill.address, "--decode", decode.address, "--model-name", fz.MODEL),
            *("--http-port", str(http_port), "--max-model-len", str(MAX_MODEL_LEN)),
            *("--api-keys-file", str(work / "api"), "--admin-keys-file", str(work / "admin")),
            *("--cluster-secret-file", str(work / "secret")),
        )
        g = SimpleNamespace(**keys, router=router, prefill=prefill, decode=decode)
        g.http_port, g.procs, g.secrets = http_port, (router, prefill, decode), tuple(keys.values())
        for _ in range(300):
            if _http(g, "GET", "/health")[0] == 200:
                break
            asyncio.run(asyncio.sleep(0.1))
        yield g
        for p in g.procs:
            assert p.stop() == 0, p.log()[-5000:]
            _assert_log_clean(p.log(), p.name, g)


def _assert_log_clean(text: str, name: str, g) -> None:
    assert "Traceback" not in text, f"{name} logged a traceback:\n{text[-20000:]}"
    assert not any(s[-16:] in text for s in g.secrets), f"{name} logged a key or the secret"


@pytest.fixture
def ended(g, oracle):
    """The end of every test (module docstring), the logs read from the test's start on."""
    marks = [(p, len(p.log_path.read_bytes())) for p in g.procs]
    yield
    for p, service in zip(g.procs, SERVICES):
        assert health_status(p.address, service) == SERVING, p.name

    async def clean():
        hooks = bearer_interceptors(g.key)
        async with grpc.aio.insecure_channel(g.router.address, interceptors=hooks) as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            await assert_clean(stub, oracle, [g.prefill.address], [g.decode.address])

    asyncio.run(clean())
    assert _http(g, "GET", "/health")[0] == 200
    for p, mark in marks:
        _assert_log_clean(p.log_path.read_bytes()[mark:].decode(errors="replace"), p.name, g)


def _no_echo(text: str, g, values) -> None:
    """No word of 12+ characters presented, and no key or secret, in a refusal's text."""
    for v in values:
        words = (v.decode(errors="replace") if isinstance(v, bytes) else v).split()
        for w in [w for w in words if len(w) >= 12]:
            assert w[:12] not in text, ("echoed", w[:40], text[:300])
    assert not any(s[:12] in text or s[-12:] in text for s in g.secrets), text[:300]


@st.composite
def credential(draw, g, http: bool, rights=None):
    """One authorization value and the router's answer to it; `rights`: the (key, answer)
    pairs of the right-key cases (default: all three keys)."""
    key, cls = draw(st.sampled_from(rights or [(g.key, PLAIN), (g.other, PLAIN), (g.admin, ADMIN)]))
    junk = draw(st.text(KEY_CHARS, min_size=16, max_size=40))
    kind = draw(st.sampled_from(["right"] * 3 + ["wrong", "mangled", "scheme", "long", "odd"]))
    if kind == "right":  # the scheme's case and spaces around the parts do not matter
        pad = st.text(st.just(" "), max_size=3)
        return f"{draw(pad)}{draw(st.sampled_from(SCHEMES))} {draw(pad)}{key}{draw(pad)}", cls
    if kind == "wrong":
        return f"{draw(st.sampled_from(SCHEMES))} {junk}", REFUSED
    if kind == "mangled":
        b64 = base64.b64encode(f"user:{key}".encode()).decode()
        odd = [f"Bearer {key[:-1]}", f"Bearer {key}x", f"Bearer x{key}", f"Bearer{key}", key]
        odd += [f"Bearer {key.swapcase()}", f"Bearer {key} {key}", f"Basic {b64}", f"Token {key}"]
        odd += [f"Bearer:{key}", f"{key} Bearer", f"Bearer {key[::-1]}"]
        odd += [f"Bearer\t{key}", f"Bearer {key}".encode() + b"\xff"] if http else []
        return draw(st.sampled_from(odd)), REFUSED
    if kind == "scheme":
        return draw(st.sampled_from(["", " ", "Bearer", "bearer  ", "Basic", "-"])), REFUSED
    if kind == "long":  # a key in the first bytes too: a refusal that quotes them must not log it
        first = draw(st.sampled_from([junk, key]))
        return f"Bearer {first}" + "x" * draw(st.sampled_from([2000, 7000, 10_240])), REFUSED
    if http:  # bytes that are no UTF-8, and non-ASCII around a key
        high = st.binary(min_size=1, max_size=30).map(lambda b: bytes(c | 0x80 for c in b))
        ctl = f"Bearer {key}".encode() + b"\x01"  # aiohttp's parser refuses control characters
        return draw(high | st.sampled_from([f"Bearer é{key}", f"Bearer {key}é", ctl])), REFUSED
    return draw(st.text(ASCII, max_size=60)), REFUSED


@st.composite
def credentials(draw, g, http: bool, rights=None):
    """Zero to three authorization values, and the answers the router may give: one of theirs
    (it reads the first one; the test need not know which)."""
    pairs = draw(st.lists(credential(g, http, rights), max_size=3))
    return [v for v, _ in pairs], {c for _, c in pairs} or {REFUSED}


EXTRA_MD = st.lists(  # metadata that holds no credential (a binary header holds "Bearer ...")
    st.tuples(st.sampled_from(["authorisation", "x-api-key", "auth"]), st.text(ASCII, max_size=20))
    | st.binary(max_size=20).map(lambda b: ("authorization-bin", b"Bearer " + b)),
    max_size=2,
)
