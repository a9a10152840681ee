"""API keys, admin keys, caller-scoped request ids, the cluster secret on RouterControl, the
private control listener and per-caller limits, through a real router and real workers."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router_helpers import (
    generate,
    greedy,
    ids_request,
    read_rest,
    router_config,
    rpc_error,
    running_router,
)

from splitserve.protos import generate_pb2, generate_pb2_grpc, router_pb2, router_pb2_grpc
from splitserve.router.registration import keep_registered
from splitserve.router.server import Router

PROMPT = [1, 44, 45, 46, 200, 201, 202]
LONG = greedy(249, ignore_eos=True)  # about 1.5 s of decoding: long enough to abort mid-stream
DECODE = generate_pb2.WORKER_ROLE_DECODE


def _key() -> str:
    return secrets.token_urlsafe(24)


def _auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture
def keys(tmp_path):
    api, admin = [_key(), _key()], _key()
    (tmp_path / "api").write_text("# one key per line\n" + "\n".join(api) + "\n")
    (tmp_path / "admin").write_text(admin + "\n")
    return {
        "files": {
            "api_keys_file": str(tmp_path / "api"),
            "admin_keys_file": str(tmp_path / "admin"),
        },
        "a": api[0],
        "b": api[1],
        "admin": admin,
    }


def test_keys_are_required_and_worker_addresses_are_for_admins(cluster, keys):
    cfg = router_config(cluster.model, [cluster.prefill], [cluster.decode], auth=keys["files"])

    async def body():
        async with running_router(cfg) as (r, stub), grpc.aio.insecure_channel(r.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            probe = await health.Check(health_pb2.HealthCheckRequest())  # probes need no key
            missing = await rpc_error(generate(stub, ids_request(PROMPT, greedy(3))))
            wrong = await rpc_error(
                stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), metadata=_auth(_key()))
            )
            served = [
                c
                async for c in stub.Generate(
                    ids_request(PROMPT, greedy(4)), metadata=_auth(keys["a"]), timeout=30
                )
            ]
            plain = await stub.GetServerInfo(
                generate_pb2.GetServerInfoRequest(), metadata=_auth(keys["b"])
            )
            admin = await stub.GetServerInfo(
                generate_pb2.GetServerInfoRequest(), metadata=_auth(keys["admin"])
            )
            await cluster.assert_free()
            return probe, missing, wrong, served, plain, admin

    probe, missing, wrong, served, plain, admin = asyncio.run(body())
    assert probe.status == health_pb2.HealthCheckResponse.SERVING
    assert missing.code() == wrong.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "API key is required" in missing.details() and "not valid" in wrong.details()
    assert keys["a"] not in wrong.details()
    assert sum(len(c.token_ids) for c in served) == 4
    assert [(w.address, w.healthy) for w in plain.workers] == [("", True), ("", True)]
    assert sorted(w.address for w in admin.workers) == sorted([cluster.prefill, cluster.decode])


def test_request_ids_belong_to_their_caller(cluster, keys):
    cfg = router_config(cluster.model, [cluster.prefill], [cluster.decode], auth=keys["files"])

    async def body():
        async with running_router(cfg) as (r, stub):
            a = stub.Generate(ids_request(PROMPT, LONG, "same-id"), metadata=_auth(keys["a"]))
            b = stub.Generate(ids_request(PROMPT, LONG, "same-id"), metadata=_auth(keys["b"]))
            # both streams decoding (3 chunks each) before any abort, so that both are found
            first_a, first_b = await a.read(), await b.read()
            for call in (a, b):
                for _ in range(2):
                    await call.read()
            # b may not abort a's request, and its own abort leaves a's running
            by_b = await stub.Abort(
                generate_pb2.AbortRequest(request_id="same-id"), metadata=_auth(keys["b"])
            )
            rest_b = await read_rest(b)
            again_b = await stub.Abort(
                generate_pb2.AbortRequest(request_id="same-id"), metadata=_auth(keys["b"])
            )
            worker_ids = [live.request_id for live in r.generate.live.values()]
            by_admin = await stub.Abort(
                generate_pb2.AbortRequest(request_id="same-id"), metadata=_auth(keys["admin"])
            )
            rest_a = await read_rest(a)
            await cluster.assert_free()
            return first_a, first_b, by_b, rest_b, again_b, worker_ids, by_admin, rest_a

    first_a, first_b, by_b, rest_b, again_b, worker_ids, by_admin, rest_a = asyncio.run(body())
    assert first_a.request_id == first_b.request_id == "same-id"  # the caller's own id comes back
    assert by_b.found and not again_b.found and by_admin.found
    assert rest_b[-1].finish_reason == generate_pb2.FINISH_REASON_ABORT
    assert rest_a[-1].finish_reason == generate_pb2.FINISH_REASON_ABORT
    # the workers see a unique id that starts with the caller's
    assert len(worker_ids) == 1 and worker_ids[0].startswith("same-id#")


def test_a_rogue_registration_on_the_public_port_is_refused(cluster, tiny_llama, monkeypatch):
    secret = _key()
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET", secret)
    cfg = router_config(tiny_llama, [cluster.prefill], [])

    async def body():
        async with (
            running_router(cfg, ready=False) as (r, _),
            grpc.aio.insecure_channel(r.address) as ch,
        ):
            stub = router_pb2_grpc.RouterControlStub(ch)
            request = router_pb2.RegisterWorkerRequest(role=DECODE, address=cluster.decode)
            rogue = await rpc_error(stub.RegisterWorker(request))
            forged = await rpc_error(stub.RegisterWorker(request, metadata=_auth(_key())))
            beat = await rpc_error(
                stub.Heartbeat(router_pb2.HeartbeatRequest(address=cluster.decode, role=DECODE))
            )
            listed_after_rogue = [w.address for w in r.registry.workers()]
            ok = await stub.RegisterWorker(request, metadata=_auth(secret))
            return (
                rogue,
                forged,
                beat,
                listed_after_rogue,
                ok,
                [w.address for w in r.registry.workers()],
            )

    rogue, forged, beat, before, ok, after = asyncio.run(body())
    assert rogue.code() == forged.code() == beat.code() == grpc.StatusCode.PERMISSION_DENIED
    assert secret not in forged.details() and "cluster" in rogue.details()
    assert cluster.decode not in before and cluster.decode in after and ok.heartbeat_interval_ms


def test_the_control_listener_takes_registration_off_the_public_port(cluster, tiny_llama):
    cfg = router_config(tiny_llama, [cluster.prefill], [], control={"port": 0})

    async def body():
        router = Router(cfg)
        await router.start()
        try:
            async with grpc.aio.insecure_channel(router.address) as public:
                on_public = await rpc_error(
                    router_pb2_grpc.RouterControlStub(public).RegisterWorker(
                        router_pb2.RegisterWorkerRequest(role=DECODE, address=cluster.decode)
                    )
                )
            stop = asyncio.Event()
            beat = asyncio.create_task(
                keep_registered(router.control_address, "decode", cluster.decode, stop)
            )
            deadline = asyncio.get_running_loop().time() + 20
            while not router.ready and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            ready = router.ready
            async with grpc.aio.insecure_channel(router.address) as ch:
                served = await generate(
                    generate_pb2_grpc.GenerateServiceStub(ch), ids_request(PROMPT, greedy(3))
                )
            stop.set()
            await beat
            await cluster.assert_free()
            return on_public, ready, served, router.control_address != router.address
        finally:
            await router.stop(grace_s=1.0)

    on_public, ready, served, separate = asyncio.run(body())
    assert on_public.code() == grpc.StatusCode.UNIMPLEMENTED
    assert ready and separate and len(served.tokens) == 3


def test_per_caller_rate_limit_answers_with_a_retry_hint(cluster, keys):
    auth = {**keys["files"], "rate_per_s": 0.05, "burst": 1}
    cfg = router_config(cluster.model, [cluster.prefill], [cluster.decode], auth=auth)

    async def body():
        async with running_router(cfg) as (r, stub):
            ok = [
                c
                async for c in stub.Generate(
                    ids_request(PROMPT, greedy(2)), metadata=_auth(keys["a"]), timeout=30
                )
            ]
            call = stub.Generate(ids_request(PROMPT, greedy(2)), metadata=_auth(keys["a"]))
            limited = await rpc_error(read_rest(call))
            trailing = dict(await call.trailing_metadata())
            other = [  # another caller has a bucket of its own
                c
                async for c in stub.Generate(
                    ids_request(PROMPT, greedy(2)), metadata=_auth(keys["b"]), timeout=30
                )
            ]
            await cluster.assert_free()
            return ok, limited, trailing, other

    ok, limited, trailing, other = asyncio.run(body())
    assert ok and other
    assert (
        limited.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in limited.details()
    )
    assert 1000 <= int(trailing["retry-after-ms"]) <= 20_000


def test_starting_beyond_loopback_without_keys_is_refused(tiny_llama):
    def build(**kw):
        cfg = router_config(tiny_llama, ["127.0.0.1:1"], ["127.0.0.1:2"], **kw)

        async def make():
            return Router(cfg)

        return asyncio.run(make())

    with pytest.raises(ValueError, match="without API keys"):
        build(server={"host": "0.0.0.0"})
    with pytest.raises(ValueError, match="without API keys"):  # the HTTP front counts too
        build(http={"port": 0, "host": "0.0.0.0"})
    opened = build(server={"host": "0.0.0.0"}, auth={"require_api_key": False})
    assert not opened.frontend.auth.keys_required
