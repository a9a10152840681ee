"""Tensor-parallel workers as real processes (CPU, gloo, 2 ranks each), around their life: a fixed
UCX port moves up per rank, a clean stop logs no error, and a follower killed while a request is
in flight fails that request with UNAVAILABLE within seconds and ends the worker (exit 1)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import grpc
import helpers_procs
import pytest
import yaml
from grpc_health.v1 import health_pb2

from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc

PROMPT = [1] + list(range(40, 77))
MAX_TOKENS = 12
COMMON = ("--block-size", "4", "--num-blocks", "96")
UNAVAILABLE_WITHIN_S = (
    30.0  # kill -> client status: ~1 s (watcher polls every 0.2 s); wide for loaded 2-core CI
)
STUCK_STEP_S = 120.0  # a prefill step that would only end long after the follower's death is seen


def _followers(pid: int) -> list[int]:
    """The TP follower processes rank 0 `pid` spawned (not multiprocessing's resource tracker)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(stat.parent.name))
    return out


def _pair_of_free_ports() -> int:
    """p with p and p + 1 both free right now."""
    for _ in range(50):
        p = helpers_procs.free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise AssertionError("no two adjacent free ports")


def _config(tmp_path: Path, name: str, data: dict) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _sampling(max_tokens: int = MAX_TOKENS):
    return generate_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if " ERROR " in line or line.startswith("Traceback")]


def test_fixed_kv_port_per_rank_and_clean_stop(tiny_llama, tmp_path):
    """kv_transfer.listen_port p (as deploy/k8s sets it): rank r listens on p + r, the handle says
    so, the hand-over to a TP2 decode worker gives TP1's tokens; SIGTERM then stops both workers
    with exit 0 and not one ERROR line (the followers' exit after ("stop",) is no failure)."""
    expected = helpers_procs.offline_greedy(tiny_llama, [PROMPT], MAX_TOKENS)[0]
    port = _pair_of_free_ports()
    cfg = _config(tmp_path, "prefill", {"kv_transfer": {"listen_port": port}})
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        p = procs.prefill_worker(
            tiny_llama, *COMMON, "--tensor-parallel-size", "2", "--config", cfg
        )
        d = procs.decode_worker(
            tiny_llama, *COMMON, "--tensor-parallel-size", "2", "--kv-failure-policy", "fail"
        )
        prefill = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(p.address))
        decode = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(d.address))
        resp = prefill.Prefill(
            worker_pb2.PrefillRequest(
                request_id="r0", prompt_token_ids=PROMPT, sampling=_sampling()
            ),
            timeout=120,
        )
        assert resp.kv.address.port == port
        assert [(s.tp_rank, s.address.port) for s in resp.kv.shards] == [(0, port), (1, port + 1)]
        req = worker_pb2.DecodeRequest(
            request_id="r0",
            prompt_token_ids=PROMPT,
            sampling=_sampling(),
            first_token_id=resp.first_token_id,
            kv=resp.kv,
        )
        tokens = [resp.first_token_id] + [
            t for c in decode.Decode(req, timeout=120) for t in c.token_ids
        ]
        assert tokens == expected
        helpers_procs.all_free(prefill)
        helpers_procs.all_free(decode)
        assert p.stop() == 0 and d.stop() == 0
        for proc in (p, d):
            assert "tensor parallel 2" in proc.log()
            assert not _errors(proc.log()), (
                f"{proc.name} logged errors at a clean stop:\n{proc.log()}"
            )


def _kill_follower_then(sp, call) -> tuple[grpc.RpcError, float]:
    """SIGKILLs the follower of `sp`, then returns the error `call()` ended with and the seconds
    from the kill to it."""
    (follower,) = _followers(sp.proc.pid)
    t0 = time.monotonic()
    os.kill(follower, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value, time.monotonic() - t0


def _exits_1(sp) -> None:
    try:
        assert sp.proc.wait(15) == 1, sp.log()
    finally:
        sp.kill()
    assert "exiting with status 1 after losing a tensor-parallel rank" in sp.log()


def test_follower_killed_mid_decode_stream(tiny_llama, tmp_path):
    """The stream ends with UNAVAILABLE within seconds; the worker goes NOT_SERVING and exits 1."""
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        d = procs.decode_worker(
            tiny_llama, "--block-size", "16", "--num-blocks", "80", "--tensor-parallel-size", "2"
        )
        stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(d.address))
        req = worker_pb2.DecodeRequest(
            request_id="long", prompt_token_ids=[1, 2, 3, 4], sampling=_sampling(1000)
        )  # far longer than the test
        stream = stub.Decode(req, timeout=120)
        assert next(stream).token_ids
        err, took = _kill_follower_then(d, lambda: [c for c in stream])
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert took < UNAVAILABLE_WITHIN_S, took
        assert (
            helpers_procs.health_status(d.address, d.service)
            != health_pb2.HealthCheckResponse.SERVING
        )
        _exits_1(d)


def test_follower_killed_mid_prefill(tiny_llama, tmp_path):
    """The prefill step is slow on purpose (the faults seam: STUCK_STEP_S), as a step stuck in a
    collective with the dead rank would be: the call still gets UNAVAILABLE long before that step
    could end (the event itself: the death, not the step, ended the call), the worker exits 1."""
    cfg = _config(
        tmp_path,
        "prefill",
        {"faults": {"last_chunk_delay_s": STUCK_STEP_S, "request_id_prefix": "slow"}},
    )
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        p = procs.prefill_worker(
            tiny_llama, *COMMON, "--tensor-parallel-size", "2", "--config", cfg
        )
        stub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(p.address))
        call = stub.Prefill.future(
            worker_pb2.PrefillRequest(
                request_id="slow-0", prompt_token_ids=PROMPT, sampling=_sampling()
            ),
            timeout=STUCK_STEP_S + 30,
        )
        deadline = time.monotonic() + 20
        while stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5).num_running < 1:  # in the step
            assert time.monotonic() < deadline and not call.done(), "the prefill never started"
            time.sleep(0.05)
        err, took = _kill_follower_then(p, call.result)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "lost" in err.details() or "rank 1" in err.details(), err.details()
        assert took < STUCK_STEP_S / 2, (
            took
        )  # 16.5 s seen on a loaded 2-core machine; the step: 120 s
        _exits_1(p)
