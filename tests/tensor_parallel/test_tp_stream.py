"""Streamed KV hand-overs between tensor-parallel workers as real processes (CPU, gloo, real UCX
over TCP loopback, a router in front): TP2 prefill -> TP1 decode, TP1 -> TP2 and TP2 -> TP2 stream
(every prefill rank streams its own heads; a TP2 decode worker spreads them over its ranks) with
the offline oracle's tokens, for one-chunk and many-chunk prompts; a prefill rank whose stream
breaks mid-way makes the request fall back to the pull (same tokens), at decode TP 1 and 2. Every block and lease is
free on every worker afterwards."""

from __future__ import annotations

import grpc
import helpers_procs
import pytest
import yaml

from splitserve.protos import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc

PROMPTS = [
    [1] + list(range(40, 100)),  # four chunks of 16 tokens
    [1, 300, 301, 302, 303, 304, 305],  # one
]
MAX_TOKENS = 10
# chunks of 16 tokens: a long prompt's pieces stream while its later chunks compute
COMMON = ("--block-size", "4", "--num-blocks", "96", "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return helpers_procs.offline_greedy(tiny_llama, PROMPTS, MAX_TOKENS)


def _generate(stub, request_id: str, prompt: list[int]):
    req = generate_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    chunks = list(stub.Generate(req, timeout=180))
    return [t for c in chunks for t in c.token_ids], chunks[-1].kv_handover


def _all_free(*workers) -> None:
    for w in workers:
        channel = grpc.insecure_channel(w.address)
        stub_cls = (
            worker_pb2_grpc.PrefillWorkerStub
            if "prefill" in w.name
            else worker_pb2_grpc.DecodeWorkerStub
        )
        helpers_procs.all_free(stub_cls(channel))


def _streaming(w) -> bool:
    stub_cls = (
        worker_pb2_grpc.PrefillWorkerStub
        if "prefill" in w.name
        else worker_pb2_grpc.DecodeWorkerStub
    )
    load = stub_cls(grpc.insecure_channel(w.address)).GetLoad(
        worker_pb2.GetLoadRequest(), timeout=10
    )
    return load.kv_streaming


def test_streamed_handover_between_tp_sizes(tiny_llama, expected, tmp_path):
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        p1 = procs.prefill_worker(tiny_llama, *COMMON, name="prefill-tp1")
        p2 = procs.prefill_worker(
            tiny_llama, *COMMON, "--tensor-parallel-size", "2", name="prefill-tp2"
        )
        d1 = procs.decode_worker(tiny_llama, *COMMON, "--kv-failure-policy", "fail", name="d1")
        d2 = procs.decode_worker(
            tiny_llama,
            *COMMON,
            "--tensor-parallel-size",
            "2",
            "--kv-failure-policy",
            "fail",
            name="decode-tp2",
        )
        assert all(_streaming(w) for w in (p1, p2, d1, d2))
        for p, d in ((p2, d1), (p1, d2), (p2, d2)):
            router = procs.router(tiny_llama, "--prefill", p.address, "--decode", d.address)
            stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(router.address))
            for i, prompt in enumerate(PROMPTS):
                tokens, hand = _generate(stub, f"{p.name}-{d.name}-{i}", prompt)
                assert tokens == expected[i], (p.name, d.name, i)
                assert hand.streamed and not hand.recomputed and not hand.stream_fallback, hand
            _all_free(p, d)
            assert router.stop() == 0
        for w in (p1, p2, d1, d2):
            assert w.stop() == 0
            assert " ERROR " not in w.log(), w.log()


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_broken_shard_stream_falls_back_to_the_pull(tiny_llama, expected, tmp_path, decode_tp):
    """Rank 1's stream dies after one piece: the decode worker aborts rank 0's stream too, frees
    its blocks and answers kv_stream_fallback; the router's pull (the lease untouched) delivers."""
    faults = tmp_path / "faults.yaml"
    faults.write_text(
        yaml.safe_dump(
            {
                "faults": {
                    "transfer": {
                        "stream_break_after_pieces": 1,
                        "stream_break_rank": 1,
                        "request_id_prefix": "brk",
                    }
                }
            }
        )
    )
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        p = procs.prefill_worker(
            tiny_llama,
            *COMMON,
            "--tensor-parallel-size",
            "2",
            "--config",
            str(faults),
            name="prefill-tp2",
        )
        d = procs.decode_worker(
            tiny_llama,
            *COMMON,
            "--tensor-parallel-size",
            str(decode_tp),
            "--kv-failure-policy",
            "fail",
            name="decode",
        )
        router = procs.router(tiny_llama, "--prefill", p.address, "--decode", d.address)
        stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(router.address))
        for i, prompt in enumerate(PROMPTS):
            tokens, hand = _generate(stub, f"brk{i}", prompt)
            assert tokens == expected[i]
            assert not hand.streamed and not hand.recomputed, hand
            assert hand.stream_fallback == "peer_failed", hand
        tokens, hand = _generate(stub, "ok0", PROMPTS[0])  # no fault: streamed
        assert tokens == expected[0] and hand.streamed, hand
        _all_free(p, d)
        assert router.stop() == 0 and p.stop() == 0 and d.stop() == 0
