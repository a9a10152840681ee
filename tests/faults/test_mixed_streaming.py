"""Mixed streaming support between real processes: a worker started with `kv_transfer.streaming`
off (GetLoad.kv_streaming false) next to a peer with it on. The router (kv_streaming on) must
hand over through such a pair by the classic pull after the prefill (`kv_handover.streamed`
false, nothing recomputed), with the offline oracle's tokens, the same as the all-streaming
pair's; every KV block and lease is free on both workers at the end."""

from __future__ import annotations

import asyncio

import grpc
from fault_helpers import start_worker
from router_helpers import assert_workers_free
from test_stream_handover import _run  # the same router run, streaming on

from splitserve.protos import worker_pb2, worker_pb2_grpc
from splitserve.request.sampling_params import SamplingParams

PROMPTS = [
    [1] + [(11 * i) % 500 + 3 for i in range(60)],
    [1, 44, 45, 46, 200, 201, 202],
    [1] + [(7 * i + 5) % 400 + 3 for i in range(33)],
]
MAX_TOKENS = 10


def _streams(address: str, role: str) -> bool:
    stub_cls = (
        worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    )
    with grpc.insecure_channel(address) as ch:
        return stub_cls(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=10).kv_streaming


def test_a_worker_without_streaming_gets_the_pull_with_the_same_tokens(cluster, oracle, procs):
    off = {"streaming": False}
    prefill_off, _ = start_worker(
        procs, "prefill", cluster.model, None, kv_transfer=off, wait=False
    )
    decode_off, _ = start_worker(procs, "decode", cluster.model, None, kv_transfer=off, wait=False)
    prefill_off.wait_serving()
    decode_off.wait_serving()
    # the shared workers stream; the new ones say they do not
    assert _streams(cluster.prefill, "prefill") and _streams(cluster.decode, "decode")
    assert not _streams(prefill_off.address, "prefill")
    assert not _streams(decode_off.address, "decode")

    want = [
        oracle(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)).token_ids
        for p in PROMPTS
    ]
    both = asyncio.run(
        _run(cluster.model, cluster.prefill, cluster.decode, PROMPTS, MAX_TOKENS, prefix="mix-both")
    )
    for r, w in zip(both, want):
        assert r.tokens == w
        assert r.last.kv_handover.streamed and not r.last.kv_handover.recomputed, r.last

    pairs = {
        "streaming prefill, decode without": (cluster.prefill, decode_off.address),
        "prefill without, streaming decode": (prefill_off.address, cluster.decode),
    }
    for k, (what, (prefill, decode)) in enumerate(pairs.items()):
        results = asyncio.run(
            _run(cluster.model, prefill, decode, PROMPTS, MAX_TOKENS, prefix=f"mix-{k}-")
        )
        for r, w, s in zip(results, want, both):
            assert r.tokens == w == s.tokens, what
            hand = r.last.kv_handover
            assert r.last.HasField("kv_handover"), (what, r.last)
            assert not hand.streamed and not hand.recomputed, (what, hand)
            assert hand.stream_fallback == "", (what, hand)  # never tried: no stream to fall from
            assert hand.transfer_ms > 0, (what, hand)  # the KV was pulled
    # every block and lease free on all four workers
    asyncio.run(
        assert_workers_free(
            [cluster.prefill, prefill_off.address], [cluster.decode, decode_off.address]
        )
    )
