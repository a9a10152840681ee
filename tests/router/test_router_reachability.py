"""A worker that advertises an address the router cannot dial fails at RegisterWorker with
FAILED_PRECONDITION naming --advertise-host, not at its first request or KV transfer: the
gRPC address itself, and a prefill worker's advertised KV (UCX) listener. Reachable workers
register as before, and the router's TCP dial of a UCX listener leaves it working."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import grpc
from helpers_procs import free_port
from router_helpers import (
    generate,
    greedy,
    ids_request,
    router_config,
    rpc_error,
    running_router,
    wait_until,
)

from splitserve.prefill_worker.config import PrefillWorkerConfig
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.protos import generate_pb2, router_pb2, router_pb2_grpc
from splitserve.request.sampling_params import SamplingParams
from splitserve.router.registration import keep_registered

DECODE = generate_pb2.WORKER_ROLE_DECODE
PREFILL = generate_pb2.WORKER_ROLE_PREFILL


def _pulls(cluster) -> tuple[float, float]:
    """(failed KV pulls, KV bytes received) so far on the cluster's decode worker (its /metrics)."""
    url = f"http://127.0.0.1:{cluster.decode_metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    failed = sum(
        float(m)
        for m in re.findall(r"^splitserve_kv_transfer_failures_total\{.*\} (\S+)$", text, re.M)
    )
    received = re.search(
        r'^splitserve_kv_transfer_bytes_total\{direction="received"\} (\S+)$', text, re.M
    )
    return failed, float(received.group(1)) if received else 0.0


def _misadvertised_prefill(model) -> PrefillWorker:
    """A real prefill worker bound to 127.0.0.1 that advertises ::1, where its UCX listener
    (IPv4, every interface) does not listen: what decode workers would dial is unreachable."""
    return PrefillWorker(
        PrefillWorkerConfig.model_validate(
            {
                "engine": {
                    "model_path": str(model),
                    "device": "cpu",
                    "cache": {"num_blocks": 16, "block_size": 4},
                },
                "server": {
                    "host": "127.0.0.1",
                    "port": 0,
                    "advertise_host": "::1",
                    "drain_grace_s": 0.5,
                },
                "warmup": False,
            }
        )
    )


def test_unreachable_addresses_are_refused_at_registration(cluster, oracle, tiny_llama):
    nobody = f"127.0.0.1:{free_port()}"
    cfg = router_config(cluster.model, [], [], registry={"probe_timeout_s": 1.0})

    async def body():
        bad = _misadvertised_prefill(tiny_llama)
        await bad.start()
        bad_address = f"127.0.0.1:{bad.server.port}"
        try:
            async with running_router(cfg, ready=False) as (r, stub):  # noqa: SIM117 - ch needs r
                async with grpc.aio.insecure_channel(r.address) as ch:
                    ctl = router_pb2_grpc.RouterControlStub(ch)

                    def register(role, address):
                        return ctl.RegisterWorker(
                            router_pb2.RegisterWorkerRequest(role=role, address=address), timeout=10
                        )

                    refused = {
                        "closed port": await rpc_error(register(DECODE, nobody)),
                        "kv listener": await rpc_error(register(PREFILL, bad_address)),
                        "wrong role": await rpc_error(register(PREFILL, cluster.decode)),
                    }
                    sidecar = await rpc_error(
                        keep_registered(r.address, "decode", nobody, worker_wait_s=0.2)
                    )
                    listed = [w.address for w in r.registry.workers()]
                    # reachable workers register; the router's TCP dial left the UCX listener working
                    await register(PREFILL, cluster.prefill)
                    await register(DECODE, cluster.decode)
                    await wait_until(lambda: r.ready, 10, "registered workers healthy")
                    before = _pulls(cluster)
                    served = await generate(stub, ids_request([1, 5, 6, 7, 8, 9], greedy(6)))
                    pulls = [b - a for a, b in zip(before, _pulls(cluster))]
                    await cluster.assert_free()
            # listed statically (never registered), it is probed and kept out of rotation, saying why
            async with running_router(
                router_config(cluster.model, [bad_address], [cluster.decode]), ready=False
            ) as (r2, _):
                await wait_until(
                    lambda: "KV (UCX) listener" in r2.registry.get(bad_address).why,
                    10,
                    "static misadvertised prefill worker diagnosed",
                )
                static = r2.registry.get(bad_address)
                static_state = static.healthy, static.why
                # a worker in rotation whose KV listener stops answering is evicted with its own
                # reason: put it in rotation by hand (a listener cannot vanish from a live worker
                # without the worker going, which evicts as "refused" first), then one probe
                assert r2.metrics.evictions("prefill") == {}  # never healthy: no eviction
                static.healthy = True
                await wait_until(lambda: not static.healthy, 10, "KV-unreachable worker evicted")
                evictions = r2.metrics.evictions("prefill")
        finally:
            await bad.stop(0.5)
        return refused, sidecar, listed, served, pulls, static_state, evictions

    refused, sidecar, listed, served, (failed_pulls, pulled), (healthy, why), evictions = (
        asyncio.run(body())
    )
    assert evictions == {"kv_unreachable": 1}, evictions
    for what, err in refused.items():
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, what
    assert f"cannot reach decode worker {nobody}" in refused["closed port"].details()
    assert "--advertise-host" in refused["closed port"].details()
    kv = refused["kv listener"].details()
    assert "KV (UCX) listener at ::1:" in kv and "--advertise-host" in kv and "first transfer" in kv
    assert "serves no splitserve.v1.PrefillWorker" in refused["wrong role"].details()
    assert (
        sidecar.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "--advertise-host" in sidecar.details()
    )
    assert listed == []  # nothing refused made it into the registry
    assert (
        served.tokens
        == oracle([1, 5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=6)).token_ids
    )
    assert failed_pulls == 0 and pulled > 0  # the KV went over UCX, not recomputed
    assert not healthy and "--advertise-host" in why
