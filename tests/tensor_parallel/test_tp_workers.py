"""Tensor-parallel workers as real processes (CPU, gloo, 2 ranks each spawned by the worker):
real gRPC, real UCX (TCP loopback). Prefill and decode at TP 1 and 2 in every pairing hand over
with tokens identical to single-process TP1 generation; the KvHandle of a TP2 prefill carries
the shard map; every block is free on both sides afterwards."""

from __future__ import annotations

import re
import urllib.request

import grpc
import helpers_procs
import pytest

from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc
from splitserve.request.tokenizer import Tokenizer

PROMPTS = [
    [1] + list(range(40, 77)),
    [1, 300, 301, 302, 303, 304, 305],
    [1] + list(range(100, 160)),
]
MAX_TOKENS = 16
COMMON = ("--block-size", "4", "--num-blocks", "96")


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return helpers_procs.offline_greedy(tiny_llama, PROMPTS, MAX_TOKENS)


def _sampling():
    return generate_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _decode(stub, request_id, prompt, first=None, kv=None):
    req = worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=_sampling()
    )
    if first is not None:
        req.first_token_id = first
    if kv is not None:
        req.kv.CopyFrom(kv)
    tokens = [] if first is None else [first]
    for chunk in stub.Decode(req, timeout=120):
        tokens.extend(chunk.token_ids)
    return tokens


def _received_bytes(metrics_port: int) -> float:
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        .read()
        .decode()
    )
    m = re.search(r'splitserve_kv_transfer_bytes_total\{direction="received"\} ([0-9.e+]+)', text)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_handover_between_tp_sizes_equals_tp1(
    tiny_llama, expected, tmp_path, prefill_tp, decode_tp
):
    metrics = helpers_procs.free_port()
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        p = procs.prefill_worker(tiny_llama, *COMMON, "--tensor-parallel-size", str(prefill_tp))
        d = procs.decode_worker(
            tiny_llama,
            *COMMON,
            "--tensor-parallel-size",
            str(decode_tp),
            "--metrics-port",
            str(metrics),
            "--kv-failure-policy",
            "fail",
        )
        prefill = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(p.address))
        decode = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(d.address))
        for i, prompt in enumerate(PROMPTS):
            resp = prefill.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=f"r{i}", prompt_token_ids=prompt, sampling=_sampling()
                ),
                timeout=120,
            )
            if prefill_tp == 2:
                assert [(s.tp_rank, s.kv_head_start, s.kv_head_end) for s in resp.kv.shards] == [
                    (0, 0, 1),
                    (1, 1, 2),
                ]
                assert resp.kv.shards[0].address.port == resp.kv.address.port
                assert resp.kv.shards[1].address.port not in (0, resp.kv.address.port)
            else:
                assert not resp.kv.shards
            assert _decode(decode, f"r{i}", prompt, resp.first_token_id, resp.kv) == expected[i]
        payload = (
            sum(-(-len(x) // 4) for x in PROMPTS) * 2 * 3 * 4 * 2 * 16 * 4
        )  # blocks*K,V*layers*bs*heads*dim*fp32
        assert _received_bytes(metrics) == payload  # pulled (every head), not recomputed
        helpers_procs.all_free(prefill)
        helpers_procs.all_free(decode)
        for proc, tp in ((p, prefill_tp), (d, decode_tp)):
            assert (f"tensor parallel {tp}" in proc.log()) == (tp > 1)
        assert p.stop() == 0 and d.stop() == 0
        for proc in (p, d):  # the followers' exit after ("stop",) is no failure
            assert " ERROR " not in proc.log(), proc.log()


def test_tp2_decode_worker_alone_equals_tp1(tiny_llama, tmp_path):
    """Colocated requests (the prompt computed by the decode worker: the mirrored prefill path),
    sampled rows (temperature, seed: the mirrored sampling-state slot fills) and a constrained
    row (masks on rank 0, MASK graph halves on every rank) give TP1's tokens."""
    sampled = generate_pb2.SamplingParams(
        temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    constrained = generate_pb2.SamplingParams(
        temperature=0.8, seed=8, max_tokens=40, regex="[a-z]{3,8}( [0-9]{1,3}){2}"
    )
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        outs = []
        for tp in (1, 2):
            d = procs.decode_worker(tiny_llama, *COMMON, "--tensor-parallel-size", str(tp))
            stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(d.address))
            got = [_decode(stub, f"g{i}", p) for i, p in enumerate(PROMPTS)]
            req = worker_pb2.DecodeRequest(
                request_id="s", prompt_token_ids=PROMPTS[0], sampling=sampled
            )
            got.append([t for chunk in stub.Decode(req, timeout=120) for t in chunk.token_ids])
            # structured output: rank 0 fills the masks, the followers replay the same halves
            req = worker_pb2.DecodeRequest(
                request_id="c", prompt_token_ids=PROMPTS[1], sampling=constrained
            )
            got.append([t for chunk in stub.Decode(req, timeout=120) for t in chunk.token_ids])
            helpers_procs.all_free(stub)
            assert d.stop() == 0
            outs.append(got)
        assert outs[0] == outs[1]
        assert all(len(t) == MAX_TOKENS for t in outs[1][:-1])
        text = Tokenizer.from_dir(tiny_llama).decode(outs[1][-1])
        assert re.fullmatch("[a-z]{3,8}( [0-9]{1,3}){2}", text), text


def _children(pid: int) -> list[int]:
    out = []
    for stat in __import__("pathlib").Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _wait(predicate, timeout: float = 60.0) -> bool:  # a hang guard: waits for the event
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_rank0_owns_the_lifecycle(tiny_llama, tmp_path):
    """A dead follower takes its worker out of service (it exits 1, for its orchestrator to restart
    it); a dead rank 0 takes its followers along."""
    import os
    import signal

    from grpc_health.v1 import health_pb2

    with helpers_procs.ProcessGroup(tmp_path) as procs:
        d = procs.decode_worker(tiny_llama, *COMMON, "--tensor-parallel-size", "2")
        p = procs.prefill_worker(tiny_llama, *COMMON, "--tensor-parallel-size", "2")
        followers = {sp.name: _children(sp.proc.pid) for sp in (d, p)}
        assert all(len(pids) >= 1 for pids in followers.values()), followers
        for pid in followers[d.name]:
            os.kill(pid, signal.SIGKILL)
        assert _wait(
            lambda: (
                helpers_procs.health_status(d.address, d.service)
                != health_pb2.HealthCheckResponse.SERVING
            )
        ), d.log()  # NOT_SERVING, then gone
        assert d.proc.wait(60) == 1, d.log()
        p.kill()  # SIGKILL: no clean-up of its own
        assert _wait(
            lambda: (
                not any(
                    os.path.exists(f"/proc/{pid}")
                    and "zombie" not in open(f"/proc/{pid}/status").read().lower()  # noqa: SIM115
                    for pid in followers[p.name]
                )
            )
        ), "followers outlived rank 0"


def test_router_in_front_of_tp2_workers(tiny_llama, expected, tmp_path):
    """The public API through the router: TP2 prefill -> TP2 decode, tokens as TP1."""
    from splitserve.protos import generate_pb2_grpc

    with helpers_procs.ProcessGroup(tmp_path) as procs:
        p = procs.prefill_worker(tiny_llama, *COMMON, "--tensor-parallel-size", "2")
        d = procs.decode_worker(
            tiny_llama, *COMMON, "--tensor-parallel-size", "2", "--kv-failure-policy", "fail"
        )
        router = procs.router(tiny_llama, "--prefill", p.address, "--decode", d.address)
        stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(router.address))
        for i, prompt in enumerate(PROMPTS):
            req = generate_pb2.GenerateRequest(
                request_id=f"g{i}",
                token_ids=generate_pb2.TokenIds(ids=prompt),
                sampling=_sampling(),
            )
            assert [t for c in stub.Generate(req, timeout=120) for t in c.token_ids] == expected[i]
        prefill = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(p.address))
        helpers_procs.all_free(prefill)
        helpers_procs.all_free(worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(d.address)))
        assert router.stop() == 0 and p.stop() == 0 and d.stop() == 0
