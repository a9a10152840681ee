"""Tensor parallelism on 2 GPUs (NCCL; the decode steps replayed as CUDA graphs on every rank):
TP2 prefill -> TP2 decode and TP2 -> TP1 give the tokens of TP1 -> TP1, graphs replayed, every
block free afterwards. Skipped without CUDA or with fewer than 2 GPUs."""

from __future__ import annotations

import re
import urllib.request

import grpc
import helpers_procs
import pytest
import torch

from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

PROMPTS = [
    [1] + list(range(40, 77)),
    [1, 300, 301, 302, 303, 304, 305],
    [1] + list(range(100, 160)),
]
COMMON = ("--device", "cuda", "--block-size", "16", "--num-blocks", "256")


def _sampling():
    return generate_pb2.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _run(procs, model, prefill_tp: int, decode_tp: int) -> list[list[int]]:
    metrics = helpers_procs.free_port()
    p = procs.prefill_worker(model, *COMMON, "--tensor-parallel-size", str(prefill_tp), timeout=300)
    d = procs.decode_worker(
        model,
        *COMMON,
        "--tensor-parallel-size",
        str(decode_tp),
        "--max-batch-size",
        "8",
        "--metrics-port",
        str(metrics),
        "--kv-failure-policy",
        "fail",
        timeout=300,
    )
    prefill = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(p.address))
    decode = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(d.address))
    out = []
    for i, prompt in enumerate(PROMPTS):
        resp = prefill.Prefill(
            worker_pb2.PrefillRequest(
                request_id=f"r{i}", prompt_token_ids=prompt, sampling=_sampling()
            ),
            timeout=120,
        )
        assert len(resp.kv.shards) == (prefill_tp if prefill_tp > 1 else 0)
        tokens = [resp.first_token_id]
        req = worker_pb2.DecodeRequest(
            request_id=f"r{i}",
            prompt_token_ids=prompt,
            sampling=_sampling(),
            first_token_id=resp.first_token_id,
            kv=resp.kv,
        )
        for chunk in decode.Decode(req, timeout=120):
            tokens.extend(chunk.token_ids)
        out.append(tokens)
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
    replays = re.search(r"splitserve_decode_graph_replays_total ([0-9.e+]+)", text)
    assert replays and float(replays.group(1)) > 0, "decode steps did not replay CUDA graphs"
    for stub in (prefill, decode):
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
        assert load.free_blocks == load.total_blocks and load.leases_held == 0, load
    assert p.stop(60) == 0 and d.stop(60) == 0
    return out


def test_tp2_on_gpus_equals_tp1(tiny_llama, tmp_path):
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        ref = _run(procs, tiny_llama, 1, 1)
        assert _run(procs, tiny_llama, 2, 2) == ref
        assert _run(procs, tiny_llama, 2, 1) == ref
        assert _run(procs, tiny_llama, 1, 2) == ref
