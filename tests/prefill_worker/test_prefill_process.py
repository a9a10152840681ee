"""`splitserve prefill-worker` as a real process on a loopback port: health, reflection,
Prefill, GetLoad, ReleaseLease and /metrics over the wire, then SIGTERM and a clean exit."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc
from splitserve.request.block_hash import block_keys

SERVING_LINE = re.compile(
    r"serving splitserve\.v1\.PrefillWorker on ([\w.]+):(\d+).*metrics on :(\d+)"
)


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def _wait_for_serving(lines: queue.Queue, seen: list[str], timeout: float = 60.0) -> re.Match:
    while True:
        line = lines.get(timeout=timeout)
        assert line is not None, "worker exited before serving:\n" + "".join(seen)
        seen.append(line)
        if m := SERVING_LINE.search(line):
            return m


def test_worker_process_serves_grpc_and_drains_on_sigterm(tiny_llama, tmp_path):
    config = tmp_path / "prefill.yaml"
    config.write_text("engine:\n  scheduler: {max_queue_len: 8}\nmax_prefix_hashes: 2\n")
    cmd = [
        sys.executable,
        "-m",
        "splitserve.cli.main",
        "prefill-worker",
        "--model",
        str(tiny_llama),
        "--config",
        str(config),
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
        "--max-num-batched-tokens",
        "16",
        "--lease-ttl-s",
        "20",
        "--device",
        "cpu",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        m = _wait_for_serving(lines, seen)
        address, metrics_port = f"{m[1]}:{m[2]}", int(m[3])
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "splitserve.v1.PrefillWorker"):
                got = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert got.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            [answer] = refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            assert "splitserve.v1.PrefillWorker" in {
                s.name for s in answer.list_services_response.service
            }

            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            prompt = [1] + list(range(20, 60))  # 41 tokens: 3 chunks of 16, 10 full blocks
            resp = stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id="p1",
                    prompt_token_ids=prompt,
                    sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=4),
                ),
                timeout=30,
            )
            kv = resp.kv
            assert (kv.num_tokens, kv.num_blocks, kv.block_size, kv.num_layers) == (41, 11, 4, 3)
            assert (
                kv.address.host == "127.0.0.1" and kv.dtype and kv.layout and kv.model_compat_hash
            )
            assert 19_000 <= kv.ttl_ms <= 20_000 and kv.expires_at_unix_ms > 0
            load = stub.GetLoad(worker_pb2.GetLoadRequest(max_prefix_hashes=100), timeout=10)
            assert (load.role, load.leases_held, load.total_blocks) == (
                generate_pb2.WORKER_ROLE_PREFILL,
                1,
                63,
            )
            assert load.free_blocks == 63 - 11 and load.model_compat_hash == kv.model_compat_hash
            # max_prefix_hashes: 2 caps the summary at the newest two 16-byte keys, the
            # router's chained keys of the prompt's blocks 9 and 8; the 64-bit field stays empty
            assert load.prefix_cache.num_cached_blocks == 10
            assert list(load.prefix_cache.block_keys) == block_keys(prompt, 4)[9:7:-1]
            assert len(load.prefix_cache.block_hashes) == 0
            with urllib.request.urlopen(
                f"http://127.0.0.1:{metrics_port}/metrics", timeout=10
            ) as page:
                text = page.read().decode()
            assert (
                "splitserve_kv_leases_held 1.0" in text
                and "splitserve_prefill_ttft_seconds_count 1.0" in text
            )
            released = stub.ReleaseLease(
                worker_pb2.ReleaseLeaseRequest(lease_id=kv.lease_id, request_id="p1")
            )
            assert released.released
            load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
            assert (load.leases_held, load.free_blocks, load.num_running, load.num_waiting) == (
                0,
                63,
                0,
                0,
            )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    log = "".join(seen)
    assert "Traceback" not in log and "draining" in log and "prefill worker stopped" in log
