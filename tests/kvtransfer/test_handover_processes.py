"""Prefill worker -> decode worker hand-over between real processes: gRPC Prefill, a real
UCX pull (TCP loopback on CPU), gRPC Decode; tokens equal single-process generation, the
lease is released by the pull, and every block is free on both sides afterwards. Faults end
in their stated status (or a recompute with identical tokens) within the timeout."""

from __future__ import annotations

import re
import urllib.request

import grpc
import helpers_procs
import pytest

from splitserve.protos import generate_pb2, kv_pb2, worker_pb2, worker_pb2_grpc

PROMPTS = [
    [1] + list(range(40, 77)),
    [1, 300, 301, 302, 303, 304, 305],
    [1] + list(range(100, 160)),
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return helpers_procs.offline_greedy(tiny_llama, PROMPTS, MAX_TOKENS)


def _sampling():
    return generate_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _handover(
    prefill: worker_pb2_grpc.PrefillWorkerStub, decode: worker_pb2_grpc.DecodeWorkerStub, i: int
):
    resp = prefill.Prefill(
        worker_pb2.PrefillRequest(
            request_id=f"r{i}", prompt_token_ids=PROMPTS[i], sampling=_sampling()
        ),
        timeout=60,
    )
    assert resp.kv.lease_id and resp.kv.address.port > 0
    assert resp.kv.num_blocks == -(-len(PROMPTS[i]) // 4)  # spans many 4-token blocks
    tokens = [resp.first_token_id]
    for chunk in decode.Decode(
        worker_pb2.DecodeRequest(
            request_id=f"r{i}",
            prompt_token_ids=PROMPTS[i],
            first_token_id=resp.first_token_id,
            sampling=_sampling(),
            kv=resp.kv,
        ),
        timeout=60,
    ):
        tokens.extend(chunk.token_ids)
    return tokens


def _stubs(p, d):
    return (
        worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(p.address)),
        worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(d.address)),
    )


def _all_free(stub) -> worker_pb2.WorkerLoad:
    helpers_procs.all_free(stub)  # polled: a lease goes once KvPullDone (sent after the pull) lands
    return stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


def _received_bytes(metrics_port: int) -> float:
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        .read()
        .decode()
    )
    m = re.search(r'splitserve_kv_transfer_bytes_total\{direction="received"\} ([0-9.e+]+)', text)
    return float(m.group(1)) if m else 0.0


def test_handover_over_ucx_equals_single_process(tiny_llama, expected, tmp_path):
    metrics = helpers_procs.free_port()
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        p = procs.prefill_worker(tiny_llama, "--block-size", "4", "--num-blocks", "96")
        d = procs.decode_worker(
            tiny_llama,
            "--block-size",
            "4",
            "--num-blocks",
            "96",
            "--metrics-port",
            str(metrics),
            "--kv-failure-policy",
            "fail",
        )
        prefill, decode = _stubs(p, d)
        for i in range(len(PROMPTS)):
            assert _handover(prefill, decode, i) == expected[i]
        payload = (
            sum(-(-len(x) // 4) for x in PROMPTS) * 2 * 3 * 4 * 2 * 16 * 4
        )  # blocks*K,V*layers*bs*heads*dim*fp32
        assert _received_bytes(metrics) == payload  # pulled, not recomputed
        _all_free(prefill)
        _all_free(decode)
        # idle after hand-overs: the KV listener probes for the next pull (kvtransfer/idle_wait.py)
        # instead of polling a pending receive from the event loop (that kept ~1 core busy)
        # (the quieter of two 5 s windows: a stray GC or log flush may land in one of them)
        pids = {"prefill": p.proc.pid, "decode": d.proc.pid}
        windows = [helpers_procs.cpu_share(pids, 5.0) for _ in range(2)]
        busy = {name: min(w[name] for w in windows) for name in pids}
        # issue 32's goal: 2 % of a core. Measured 96 % for the prefill worker before the probe,
        # 3-4 % with ucxx's progress thread waking every 1 ms (kvtransfer/progress_wait.py)
        print("idle CPU share", windows)
        assert all(share <= 0.02 for share in busy.values()), windows
        assert p.stop() == 0 and d.stop() == 0


def test_expired_lease_and_dead_prefill_follow_the_policy(tiny_llama, expected, tmp_path):
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        p = procs.prefill_worker(
            tiny_llama, "--block-size", "4", "--num-blocks", "96", "--lease-ttl-s", "0.3"
        )
        recompute = procs.decode_worker(
            tiny_llama, "--block-size", "4", "--num-blocks", "96", "--kv-connect-timeout-s", "2"
        )
        fail = procs.decode_worker(
            tiny_llama,
            "--block-size",
            "4",
            "--num-blocks",
            "96",
            "--kv-failure-policy",
            "fail",
            "--kv-connect-timeout-s",
            "2",
        )
        prefill, dec_recompute = _stubs(p, recompute)
        dec_fail = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(fail.address))

        def decode(stub, i, resp):
            tokens = [resp.first_token_id]
            for chunk in stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id=f"x{i}-{id(stub)}",
                    prompt_token_ids=PROMPTS[i],
                    first_token_id=resp.first_token_id,
                    sampling=_sampling(),
                    kv=resp.kv,
                ),
                timeout=30,
            ):
                tokens.extend(chunk.token_ids)
            return tokens

        def prefill_one(i):
            return prefill.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=f"e{i}", prompt_token_ids=PROMPTS[i], sampling=_sampling()
                ),
                timeout=60,
            )

        import time

        stale = prefill_one(0)
        time.sleep(0.8)  # the lease expires on the prefill side
        assert decode(dec_recompute, 0, stale) == expected[0]  # recomputed: same tokens
        with pytest.raises(grpc.RpcError) as info:
            decode(dec_fail, 0, stale)
        assert (
            info.value.code() == grpc.StatusCode.UNAVAILABLE
            and "lease_expired" in info.value.details()
        )
        _all_free(prefill)
        orphan = prefill_one(1)
        p.kill()  # the prefill worker dies before anyone pulls
        assert decode(dec_recompute, 1, orphan) == expected[1]
        with pytest.raises(grpc.RpcError) as info:
            decode(dec_fail, 1, orphan)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        _all_free(dec_recompute)
        _all_free(worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(fail.address)))


def test_layout_mismatch_is_failed_precondition(tiny_llama, tmp_path):
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        p = procs.prefill_worker(tiny_llama, "--block-size", "4", "--num-blocks", "64")
        d = procs.decode_worker(tiny_llama, "--block-size", "8", "--num-blocks", "64")
        prefill, decode = _stubs(p, d)
        resp = prefill.Prefill(
            worker_pb2.PrefillRequest(
                request_id="m", prompt_token_ids=PROMPTS[1], sampling=_sampling()
            ),
            timeout=60,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(
                decode.Decode(
                    worker_pb2.DecodeRequest(
                        request_id="m",
                        prompt_token_ids=PROMPTS[1],
                        first_token_id=resp.first_token_id,
                        sampling=_sampling(),
                        kv=resp.kv,
                    ),
                    timeout=30,
                )
            )
        assert (
            info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            and "block_size" in info.value.details()
        )
        prefill.ReleaseLease(
            worker_pb2.ReleaseLeaseRequest(lease_id=resp.kv.lease_id, request_id="m"), timeout=10
        )
        _all_free(prefill)
        _all_free(decode)


def test_a_guessed_lease_id_pulls_nothing(tiny_llama, expected, tmp_path):
    """A pull authorised only by the lease id: ids are random uuid4 (122 bits), a guess is
    refused without touching the real lease, whose own pull then works as usual."""
    import uuid

    with helpers_procs.ProcessGroup(tmp_path) as procs:
        p = procs.prefill_worker(tiny_llama, "--block-size", "4", "--num-blocks", "96")
        d = procs.decode_worker(
            tiny_llama, "--block-size", "4", "--num-blocks", "96", "--kv-failure-policy", "fail"
        )
        prefill, decode = _stubs(p, d)
        resp = prefill.Prefill(
            worker_pb2.PrefillRequest(
                request_id="victim", prompt_token_ids=PROMPTS[0], sampling=_sampling()
            ),
            timeout=60,
        )
        assert uuid.UUID(hex=resp.kv.lease_id).version == 4
        forged = kv_pb2.KvHandle()
        forged.CopyFrom(resp.kv)
        forged.lease_id = uuid.uuid4().hex
        with pytest.raises(grpc.RpcError) as info:
            list(
                decode.Decode(
                    worker_pb2.DecodeRequest(
                        request_id="victim",
                        prompt_token_ids=PROMPTS[0],
                        first_token_id=resp.first_token_id,
                        sampling=_sampling(),
                        kv=forged,
                    ),
                    timeout=30,
                )
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "lease_unknown" in info.value.details() and forged.lease_id not in p.log()
        held = prefill.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
        assert held.leases_held == 1  # the victim's lease is untouched
        tokens = [resp.first_token_id]
        for chunk in decode.Decode(
            worker_pb2.DecodeRequest(
                request_id="victim",
                prompt_token_ids=PROMPTS[0],
                first_token_id=resp.first_token_id,
                sampling=_sampling(),
                kv=resp.kv,
            ),
            timeout=60,
        ):
            tokens.extend(chunk.token_ids)
        assert tokens == expected[0]
        _all_free(prefill)
        _all_free(decode)
        assert resp.kv.lease_id not in p.log()  # never logged below WARNING (no expiry here)
        assert p.stop() == 0 and d.stop() == 0
