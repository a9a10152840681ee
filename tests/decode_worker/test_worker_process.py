"""The decode worker as a real process on a loopback port: health, a Decode stream equal to
isolated generation, GetLoad, Prometheus metrics, then SIGTERM drains and exits 0."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import grpc
from decode_helpers import MAX_MODEL_LEN, collect_stream, decode_request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc
from splitserve.request.sampling_params import SamplingParams

READY = re.compile(r"serving splitserve\.v1\.DecodeWorker on ([\d.]+:\d+).*metrics on :(\d+)")


def _start(model) -> tuple[subprocess.Popen, str, int, list[str]]:
    cmd = [
        sys.executable,
        "-m",
        "splitserve.cli.decode_worker_cmd",
        "--model",
        str(model),
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--num-blocks",
        "64",
        "--block-size",
        "4",
        "--max-batch-size",
        "4",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--drain-grace-s",
        "5",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    ready = threading.Event()
    found: list[re.Match] = []

    def pump() -> None:  # keeps the pipe drained for the whole run
        for line in proc.stderr:
            lines.append(line)
            m = READY.search(line)
            if m and not found:
                found.append(m)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(60) or not found:
        proc.kill()
        raise AssertionError("decode worker did not start:\n" + "".join(lines))
    return proc, found[0].group(1), int(found[0].group(2)), lines


def test_decode_worker_process_serves_and_drains_on_sigterm(tiny_llama, oracle):
    proc, address, metrics_port, lines = _start(tiny_llama)
    try:
        prompt = [1, 44, 45, 46, 200, 201]
        ref = oracle(prompt, SamplingParams(temperature=0, max_tokens=24))

        async def client():
            async with grpc.aio.insecure_channel(address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                got = await health.Check(
                    health_pb2.HealthCheckRequest(service="splitserve.v1.DecodeWorker")
                )
                assert got.status == health_pb2.HealthCheckResponse.SERVING
                stub = worker_pb2_grpc.DecodeWorkerStub(ch)
                tokens, chunks = await collect_stream(
                    stub.Decode(
                        decode_request(
                            "p1", prompt, ref.token_ids[0], temperature=0, max_tokens=24
                        ),
                        timeout=30,
                    )
                )
                assert tokens == ref.token_ids[1:]
                load = await stub.GetLoad(worker_pb2.GetLoadRequest())
                assert load.free_blocks == load.total_blocks == 63 and load.num_running == 0
                # a stream still running at SIGTERM is finished within the drain grace period
                call = stub.Decode(
                    decode_request(
                        "p2",
                        prompt,
                        ref.token_ids[0],
                        temperature=0,
                        max_tokens=150,
                        ignore_eos=True,
                    ),
                    timeout=30,
                )
                it = call.__aiter__()
                first = await it.__anext__()
                proc.send_signal(signal.SIGTERM)
                rest = [c async for c in call]
                return len(first.token_ids) + sum(len(c.token_ids) for c in rest), rest[
                    -1
                ].finish_reason

        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
            .read()
            .decode()
        )
        assert "splitserve_decode_eager_steps_total 0.0" in metrics
        n, reason = asyncio.run(client())
        assert n == 149 and reason == generate_pb2.FINISH_REASON_LENGTH
        assert proc.wait(30) == 0, "".join(lines)
        assert any("decode worker stopped" in line for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
