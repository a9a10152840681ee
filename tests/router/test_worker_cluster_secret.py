"""Workers started with a cluster secret take calls only from its holders: a stranger's Prefill,
Decode or GetLoad is UNAUTHENTICATED (health stays open for probes), while the router, which
holds the secret, serves requests through them as before."""

from __future__ import annotations

import asyncio
import secrets

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers_procs import ProcessGroup
from router_helpers import (
    assert_workers_free,
    generate,
    greedy,
    ids_request,
    router_config,
    rpc_error,
    running_router,
    worker_flags,
)

from splitserve.protos import worker_pb2, worker_pb2_grpc


def test_workers_refuse_callers_without_the_cluster_secret(tiny_llama, tmp_path, monkeypatch):
    secret = secrets.token_urlsafe(24)
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET", secret)  # the workers and this router
    with ProcessGroup(tmp_path) as procs:
        prefill = procs.prefill_worker(tiny_llama, *worker_flags(), wait=False)
        decode = procs.decode_worker(tiny_llama, *worker_flags(), wait=False)
        prefill.wait_serving()
        decode.wait_serving()

        async def body():
            async with (
                grpc.aio.insecure_channel(prefill.address) as p,
                grpc.aio.insecure_channel(decode.address) as d,
            ):
                health = await health_pb2_grpc.HealthStub(p).Check(health_pb2.HealthCheckRequest())
                load = await rpc_error(
                    worker_pb2_grpc.PrefillWorkerStub(p).GetLoad(worker_pb2.GetLoadRequest())
                )
                forged = (("authorization", f"Bearer {secrets.token_urlsafe(24)}"),)
                prefill_call = await rpc_error(
                    worker_pb2_grpc.PrefillWorkerStub(p).Prefill(
                        worker_pb2.PrefillRequest(request_id="x", prompt_token_ids=[1, 2, 3]),
                        metadata=forged,
                    )
                )
                decode_call = worker_pb2_grpc.DecodeWorkerStub(d).Decode(
                    worker_pb2.DecodeRequest(request_id="y", prompt_token_ids=[1, 2, 3])
                )
                decode_refused = await rpc_error(decode_call.read())
            cfg = router_config(tiny_llama, [prefill.address], [decode.address])
            async with running_router(cfg) as (_, stub):
                served = await generate(stub, ids_request([1, 44, 45, 46], greedy(4)))
            await assert_workers_free([prefill.address], [decode.address])
            return health, load, prefill_call, decode_refused, served

        health, load, prefill_call, decode_refused, served = asyncio.run(body())
        assert prefill.stop() == 0 and decode.stop() == 0
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    for err in (load, prefill_call, decode_refused):
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
        assert "cluster secret" in err.details() and secret not in err.details()
    assert len(served.tokens) == 4


def test_a_worker_beyond_loopback_needs_a_cluster_secret(tiny_llama, monkeypatch):
    """Bound beyond loopback without a secret, a worker refuses to start (one line, exit 2)
    unless told --open-to-all."""
    import os
    import subprocess

    from helpers_procs import cli_command, free_port

    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET_FILE", raising=False)
    argv = [
        *cli_command("prefill-worker"),
        "--model",
        str(tiny_llama),
        "--device",
        "cpu",
        "--host",
        "0.0.0.0",
        "--port",
        str(free_port()),
    ]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=os.environ)
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "cluster secret" in lines[0] and "Traceback" not in refused.stderr


def test_open_to_all_starts_a_worker_beyond_loopback_without_a_secret(tiny_llama, monkeypatch):
    """--open-to-all is the explicit opt-out: the same worker starts, serves its health to anyone
    and stops cleanly on SIGTERM."""
    import os
    import signal
    import subprocess
    import time

    from grpc_health.v1 import health_pb2
    from helpers_procs import cli_command, free_port, health_status

    from splitserve.protos import worker_pb2, worker_pb2_grpc

    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET_FILE", raising=False)
    port = free_port()
    argv = [
        *cli_command("prefill-worker"),
        *("--model", str(tiny_llama), "--device", "cpu", "--block-size", "4"),
        *("--num-blocks", "32", "--host", "0.0.0.0", "--port", str(port), "--open-to-all"),
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ
    )
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            status = health_status(f"127.0.0.1:{port}", "splitserve.v1.PrefillWorker")
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.SERVING, proc.poll()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # no secret needed
            load = worker_pb2_grpc.PrefillWorkerStub(channel).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=10
            )
        assert load.total_blocks > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
