"""Colocated decoding (no prefill worker): a Decode without first_token_id computes the prompt
in the decode engine's own loop, samples the first token on the host and streams it first.
The whole stream equals isolated generation (OfflineEngine), greedy and seeded, with requests
joining a running batch, long prompts split over several prefill calls, and first tokens that
already finish the request; every test ends with all blocks free."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from decode_helpers import (
    Collected,
    assert_all_free,
    collect_stream,
    drive,
    make_engine,
    serving,
    submit,
)

from splitserve.decode_worker.engine import DecodeEngine
from splitserve.decode_worker.sequence import DecodeInput
from splitserve.protos import generate_pb2, worker_pb2
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.tokenizer import Tokenizer


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _colocated(engine: DecodeEngine, col: Collected, rid: str, prompt, params) -> None:
    engine.submit(DecodeInput(rid, list(prompt), None, params), col.sink(rid))


def _check(col: Collected, want: dict) -> None:
    for rid, ref in want.items():
        assert col.tokens[rid] == ref.token_ids, rid  # the first token included
        assert col.final[rid].finish_reason == ref.finish_reason, rid


@pytest.mark.parametrize(
    "overlap,chunk", [(True, 512), (False, 512), (True, 5), (False, 7), (True, 0)]
)
def test_colocated_joins_running_batch_and_matches_isolated(tiny_llama, oracle, overlap, chunk):
    # chunk: prefill_chunk_tokens (5 and 7 split these 4..30-token prompts over several steps;
    # 0 computes each prompt whole in the step that admits it)
    engine = make_engine(tiny_llama, overlap=overlap, max_batch_size=4, prefill_chunk_tokens=chunk)
    prompts = _prompts(6, seed=11)
    params = [
        SamplingParams(temperature=0, max_tokens=14),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, seed=123, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=6, repetition_penalty=1.3),
    ]
    join_at = [0, 0, 2, 3, 5, 9]
    col, want, arrivals = Collected(), {}, {}
    for i, (p, sp, at) in enumerate(zip(prompts, params, join_at)):
        want[f"c{i}"] = ref = oracle(p, sp)
        if (
            i == 4
        ):  # a handed-off request (KV present, first token from "prefill") in the same batch
            arrivals.setdefault(at, []).append(
                lambda p=p, sp=sp, ref=ref: submit(
                    engine, col, "c4", p, ref.token_ids[0], sp, with_kv=True
                )
            )
            continue
        arrivals.setdefault(at, []).append(
            lambda i=i, p=p, sp=sp: _colocated(engine, col, f"c{i}", p, sp)
        )
    drive(engine, arrivals)
    col.tokens["c4"][:0] = [
        want["c4"].token_ids[0]
    ]  # the handed-off stream starts after the first token
    _check(col, want)
    lps = col.logprobs["c2"]
    assert len(lps) == len(want["c2"].token_ids) and all(len(lp.top) == 2 for lp in lps)
    for got, ref in zip(lps, want["c2"].logprobs):
        assert got.token_id == ref.token_id and got.logprob == pytest.approx(ref.logprob, abs=1e-4)
    got = engine.metrics.registry.get_sample_value
    assert got("splitserve_decode_prompt_tokens_total") == sum(
        len(prompts[i]) for i in (0, 1, 2, 3, 5)
    )
    assert got("splitserve_decode_recomputed_tokens_total") == 0
    assert_all_free(engine)


def test_first_token_finishes_and_long_prompts_span_prefill_calls(tiny_llama, oracle):
    base = make_engine(tiny_llama, max_batch_size=4).cfg
    sched = base.engine.scheduler.model_copy(update={"max_num_batched_tokens": 16})
    cfg = base.model_copy(update={"engine": base.engine.model_copy(update={"scheduler": sched})})
    engine = DecodeEngine(cfg, tokenizer=Tokenizer.from_dir(tiny_llama))
    [short] = _prompts(1, seed=3)
    long_prompts = _prompts(2, seed=4, lo=40, hi=60)  # > 16 tokens: several prefill calls
    first = oracle(short, SamplingParams(temperature=0, max_tokens=4)).token_ids[0]
    seeded_first = oracle(short, SamplingParams(temperature=0.9, seed=42, max_tokens=1)).token_ids[
        0
    ]
    cases = {
        "one": (short, SamplingParams(temperature=0, max_tokens=1)),
        "stop": (short, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first])),
        "stop_seeded": (
            short,
            SamplingParams(temperature=0.9, seed=42, max_tokens=8, stop_token_ids=[seeded_first]),
        ),
        "long0": (long_prompts[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
        "long1": (
            long_prompts[1],
            SamplingParams(temperature=0.6, seed=9, max_tokens=10, ignore_eos=True),
        ),
    }
    col, want = Collected(), {}
    for rid, (p, sp) in cases.items():
        want[rid] = oracle(p, sp)
        _colocated(engine, col, rid, p, sp)
    drive(engine, {})
    _check(col, want)
    assert col.tokens["one"] == [first] and col.final["one"].finish_reason == "length"
    for rid, tok in (("stop", first), ("stop_seeded", seeded_first)):
        assert col.tokens[rid] == [tok] and col.final[rid].stop_reason == tok, rid
    assert_all_free(engine)


@pytest.mark.parametrize("chunk", [512, 3, 0])
def test_colocated_under_preemption_keeps_tokens(tiny_llama, oracle, chunk):
    # 4-token blocks; 4 sequences growing to ~45 tokens need ~48 blocks, the pool has 30
    engine = make_engine(tiny_llama, num_blocks=31, max_batch_size=4, prefill_chunk_tokens=chunk)
    col, want = Collected(), {}
    for i, p in enumerate(_prompts(4, seed=7, lo=6, hi=14)):
        sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        want[f"p{i}"] = oracle(p, sp)
        _colocated(engine, col, f"p{i}", p, sp)
    drive(engine, {})
    assert engine.scheduler.num_preemptions > 0
    _check(col, want)
    assert_all_free(engine)


def test_kv_without_first_token_is_refused(tiny_llama):
    engine = make_engine(tiny_llama)
    got = engine.allocator.allocate(1)
    with pytest.raises(Exception, match="first_token_id"):
        engine.admit(
            DecodeInput("x", [1, 2, 3], None, SamplingParams(max_tokens=4)),
            list(got.block_ids),
            Collected().sink("x"),
        )
    assert_all_free(engine)


def test_decode_rpc_without_first_token_matches_isolated(tiny_llama, oracle):
    prompts = _prompts(3, seed=21)
    sps = [
        dict(temperature=0, max_tokens=12),
        dict(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True),
        dict(temperature=0, max_tokens=1),
    ]

    async def main():
        async with serving(tiny_llama) as (worker, stub, _):
            reqs = [
                worker_pb2.DecodeRequest(
                    request_id=f"g{i}",
                    prompt_token_ids=p,
                    sampling=generate_pb2.SamplingParams(**sp),
                )
                for i, (p, sp) in enumerate(zip(prompts, sps))
            ]
            assert not reqs[0].HasField("first_token_id")
            results = await asyncio.gather(*(collect_stream(stub.Decode(r)) for r in reqs))
            for (tokens, chunks), p, sp in zip(results, prompts, sps):
                ref = oracle(p, SamplingParams(**sp))
                assert tokens == ref.token_ids
                # this worker's queue and its own prefill: both inside queue_time_ms
                first = chunks[0]
                assert first.local_prefill_ms > 0 and first.admit_wait_ms >= 0
                assert first.admit_wait_ms + first.local_prefill_ms <= first.queue_time_ms + 0.01
                assert chunks[-1].finish_reason == (
                    generate_pb2.FINISH_REASON_LENGTH
                    if ref.finish_reason == "length"
                    else generate_pb2.FINISH_REASON_STOP
                )
            bad = worker_pb2.DecodeRequest(
                request_id="bad",
                prompt_token_ids=prompts[0],
                sampling=generate_pb2.SamplingParams(max_tokens=4),
            )
            bad.kv.lease_id = "lease-x"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect_stream(stub.Decode(bad))
            assert (
                err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                and "first_token_id" in err.value.details()
            )
            assert_all_free(worker.engine)

    asyncio.run(main())
