"""`splitserve router` as a real process in front of real workers: health, Generate, /metrics,
SIGTERM drains and exits 0; a bad flag is one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import grpc
from helpers_procs import ProcessGroup, cli_command, free_port

from splitserve.protos import generate_pb2, generate_pb2_grpc


def test_router_process_serves_and_drains_on_sigterm(cluster, oracle, tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text(
        "model_name: tiny\nmax_model_len: 256\nrouting: {decode_policy: round_robin}\n"
    )
    metrics_port = free_port()
    with ProcessGroup(tmp_path) as procs:
        router = procs.router(
            cluster.model,
            "--config",
            str(config),
            "--prefill",
            cluster.prefill,
            "--decode",
            cluster.decode,
            "--prefill-policy",
            "least-loaded",
            "--metrics-port",
            str(metrics_port),
            "--poll-interval-s",
            "0.2",
        )
        with grpc.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            text = "The quick brown fox"
            chunks = list(
                stub.Generate(
                    generate_pb2.GenerateRequest(
                        text=text,
                        sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=10),
                    ),
                    timeout=30,
                )
            )
            info = stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)
        page = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
            .read()
            .decode()
        )
        assert router.stop() == 0
        log = router.log()
    ref = oracle(oracle.tokenizer.encode(text), _greedy(10))
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    assert info.model_name == "tiny" and info.max_model_len == 256 and len(info.workers) == 2
    assert "splitserve_router_ttft_seconds_count 1.0" in page
    assert (
        "by least_loaded" in log and "by round_robin" in log
    )  # flag over default, YAML over default
    assert "router stopped" in log and "Traceback" not in log


def test_bad_flags_are_one_line_and_exit_code_2(tiny_llama):
    done = subprocess.run(
        [*cli_command("router"), "--model", str(tiny_llama), "--decode-policy", "prefix-aware"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip().count("\n") == 0
        and "decode workers report no prefix cache" in done.stderr
    )
    done = subprocess.run(
        [*cli_command("router"), "--model", str(tiny_llama), "--prefill-policy", "fastest"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        done.returncode == 2 and "choose round-robin, least-loaded or prefix-aware" in done.stderr
    )


def _greedy(n: int):
    from splitserve.request.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n)


def test_router_imports_no_worker_package_and_no_torch():
    code = (
        "import sys, splitserve.router.server, splitserve.router.registration, splitserve.cli.router_cmd; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[:2] in "
        "(['splitserve', 'prefill_worker'], ['splitserve', 'decode_worker'], ['splitserve', 'kvtransfer'])); "
        "print(bad); sys.exit(bool(bad))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
