"""64 hand-overs at once between one prefill and one decode worker (real processes, gRPC, UCX
over TCP only on the CPU; cuda_ipc on a GPU): every one is pulled (none recomputed, none timed
out), its tokens are the single-process engine's, and every block and lease is free on both
sides afterwards."""

from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import helpers_procs
import pytest

from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc

CONCURRENT = 64
MAX_TOKENS = 4
PROMPTS = [[1] + [200 + (7 * i + j) % 300 for j in range(5 + i % 6)] for i in range(CONCURRENT)]


@pytest.fixture(scope="module")
def expected(tiny_llama):
    # in groups: the oracle's own pool holds a few prompts at a time
    return [
        tokens
        for i in range(0, CONCURRENT, 8)
        for tokens in helpers_procs.offline_greedy(tiny_llama, PROMPTS[i : i + 8], MAX_TOKENS)
    ]


def _metric(port: int, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*{labels}[^}}]*\}})? (\S+)$", text, re.M)
    )


def test_64_concurrent_handovers_over_tcp(tiny_llama, expected, tmp_path, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # the path between hosts, not shared memory
    _concurrent_handovers(tiny_llama, expected, tmp_path)


@pytest.mark.gpu
def test_64_concurrent_handovers_on_the_gpu(tiny_llama, expected, tmp_path):
    _concurrent_handovers(tiny_llama, expected, tmp_path, "--device", "cuda")


def _concurrent_handovers(tiny_llama, expected, tmp_path, *device: str) -> None:
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    metrics = helpers_procs.free_port()
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        blocks = ["--block-size", "4", "--num-blocks", "600", *device]
        p = procs.prefill_worker(tiny_llama, *blocks)
        d = procs.decode_worker(
            tiny_llama,
            *blocks,
            "--max-batch-size",
            "64",
            "--metrics-port",
            str(metrics),
            "--kv-failure-policy",
            "fail",  # a failed pull ends the request instead of hiding behind a recompute
        )
        prefill = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(p.address))
        decode = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(d.address))
        # every prompt prefilled first: 64 leases are out when the pulls start together
        leases = list(
            ThreadPoolExecutor(16).map(
                lambda i: prefill.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id=f"c{i}", prompt_token_ids=PROMPTS[i], sampling=sampling
                    ),
                    timeout=120,
                ),
                range(CONCURRENT),
            )
        )
        assert prefill.GetLoad(worker_pb2.GetLoadRequest(), timeout=10).leases_held == CONCURRENT

        def handover(i: int) -> list[int]:
            tokens = [leases[i].first_token_id]
            for chunk in decode.Decode(
                worker_pb2.DecodeRequest(
                    request_id=f"c{i}",
                    prompt_token_ids=PROMPTS[i],
                    first_token_id=leases[i].first_token_id,
                    sampling=sampling,
                    kv=leases[i].kv,
                ),
                timeout=120,
            ):
                tokens.extend(chunk.token_ids)
            return tokens

        with ThreadPoolExecutor(CONCURRENT) as pool:
            got = list(pool.map(handover, range(CONCURRENT)))
        assert got == expected
        assert _metric(metrics, "splitserve_kv_transfer_failures_total") == 0
        payload = sum(-(-len(x) // 4) for x in PROMPTS) * 2 * 3 * 4 * 2 * 16 * 4
        assert _metric(metrics, "splitserve_kv_transfer_bytes_total", "received") == payload
        for stub in (prefill, decode):  # (a lease goes once KvPullDone, sent after the pull, lands)
            helpers_procs.all_free(stub)
        assert p.stop() == 0 and d.stop() == 0
