"""Dynamic registration over RouterControl: a registered decode worker receives requests; when
its heartbeats stop it is evicted (requests get UNAVAILABLE, the router's health goes
NOT_SERVING); heartbeats again bring it back. Bad registrations are refused clearly."""

from __future__ import annotations

import asyncio

import grpc
from router_helpers import (
    generate,
    greedy,
    ids_request,
    router_config,
    rpc_error,
    running_router,
    wait_until,
)

from splitserve.protos import generate_pb2, router_pb2, router_pb2_grpc
from splitserve.router.registration import keep_registered

DECODE = generate_pb2.WORKER_ROLE_DECODE
PREFILL = generate_pb2.WORKER_ROLE_PREFILL


def test_registered_worker_serves_is_evicted_without_heartbeats_and_returns(cluster):
    cfg = router_config(
        cluster.model,
        [cluster.prefill],
        [],
        registry={"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.5, "forget_after_s": 30},
    )

    async def body():
        async with running_router(cfg, ready=False) as (r, stub):
            no_decode = await rpc_error(generate(stub, ids_request([1, 2, 3], greedy(3))))
            stop = asyncio.Event()
            beat = asyncio.create_task(keep_registered(r.address, "decode", cluster.decode, stop))
            await wait_until(lambda: r.ready, 10, "registered decode worker healthy")
            served = await generate(stub, ids_request([1, 2, 3], greedy(5)))
            stop.set()
            await beat
            await wait_until(lambda: not r.ready, 10, "silent worker evicted")
            info = await stub.GetServerInfo(generate_pb2.GetServerInfoRequest())
            evicted = await rpc_error(generate(stub, ids_request([1, 2, 3], greedy(3))))
            stop.clear()
            beat = asyncio.create_task(keep_registered(r.address, "decode", cluster.decode, stop))
            await wait_until(lambda: r.ready, 10, "worker back after heartbeats resumed")
            back = await generate(stub, ids_request([1, 2, 3], greedy(5)))
            stop.set()
            await beat
            await cluster.assert_free()
        return no_decode, served, info, evicted, back

    no_decode, served, info, evicted, back = asyncio.run(body())
    assert no_decode.code() == evicted.code() == grpc.StatusCode.UNAVAILABLE
    assert (
        "no healthy decode worker" in evicted.details() and "no heartbeat for" in evicted.details()
    )
    assert len(served.tokens) == len(back.tokens) == 5 and served.tokens == back.tokens
    assert [(w.role, w.address, w.healthy) for w in info.workers] == [
        (PREFILL, cluster.prefill, True),
        (DECODE, cluster.decode, False),
    ]


def test_a_silent_worker_is_evicted_then_removed_and_both_are_counted(cluster):
    cfg = router_config(
        cluster.model,
        [cluster.prefill],
        [],
        registry={"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.5, "forget_after_s": 1.0},
    )

    async def body():
        async with running_router(cfg, ready=False) as (r, _):
            stop = asyncio.Event()
            beat = asyncio.create_task(keep_registered(r.address, "decode", cluster.decode, stop))
            await wait_until(lambda: r.ready, 10, "registered decode worker healthy")
            stop.set()
            await beat
            await wait_until(
                lambda: r.registry.get(cluster.decode) is None, 20, "silent worker removed"
            )
            return r.metrics.evictions("decode")

    # evicted for the silence first, then removed: each reason counted, and still visible after
    # the worker's own series went with it
    assert asyncio.run(body()) == {"heartbeat_silence": 1, "removed": 1}


def test_bad_registrations_are_refused_and_unknown_heartbeats_say_so(cluster, tiny_llama):
    cfg = router_config(tiny_llama, ["127.0.0.1:1"], [])

    async def body():
        async with (
            running_router(cfg, ready=False) as (r, _),
            grpc.aio.insecure_channel(r.address) as ch,
        ):
            stub = router_pb2_grpc.RouterControlStub(ch)
            no_role = await rpc_error(
                stub.RegisterWorker(router_pb2.RegisterWorkerRequest(address="h:1"))
            )
            bad_addr = await rpc_error(
                stub.RegisterWorker(
                    router_pb2.RegisterWorkerRequest(role=DECODE, address="no-port")
                )
            )
            taken = await rpc_error(
                stub.RegisterWorker(
                    router_pb2.RegisterWorkerRequest(role=DECODE, address="127.0.0.1:1")
                )
            )
            unknown = await stub.Heartbeat(
                router_pb2.HeartbeatRequest(address=cluster.decode, role=DECODE)
            )
            ok = await stub.RegisterWorker(
                router_pb2.RegisterWorkerRequest(role=DECODE, address=cluster.decode)
            )
            known = await stub.Heartbeat(
                router_pb2.HeartbeatRequest(address=cluster.decode, role=DECODE)
            )
            again = await stub.RegisterWorker(
                router_pb2.RegisterWorkerRequest(role=DECODE, address=cluster.decode)
            )
            listed = [(w.address, w.healthy) for w in r.registry.workers() if w.static]
        return no_role, bad_addr, taken, unknown, ok, known, again, listed

    no_role, bad_addr, taken, unknown, ok, known, again, listed = asyncio.run(body())
    assert no_role.code() == bad_addr.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "WORKER_ROLE_PREFILL or WORKER_ROLE_DECODE" in no_role.details()
    assert "not host:port" in bad_addr.details()
    assert (
        taken.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "already registered as a prefill" in taken.details()
    )
    assert not unknown.known and known.known
    assert ok.heartbeat_interval_ms == 1000 and ok.heartbeat_timeout_ms == 3000 and again == ok
    assert listed == [
        ("127.0.0.1:1", False)
    ]  # nothing listens there (listed statically, so never dialed
    # at registration; an unreachable RegisterWorker is refused: test_router_reachability.py)
