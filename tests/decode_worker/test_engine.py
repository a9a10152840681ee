"""The decode engine's continuous batching produces exactly isolated greedy generation, with
requests joining and leaving at different steps, under preemption, and with mixed sampling;
aborts free blocks within one step; every test ends with all blocks free."""

from __future__ import annotations

import random

import pytest
from decode_helpers import Collected, assert_all_free, drive, make_engine, submit

from splitserve.decode_worker.graph_runner import GREEDY
from splitserve.request.sampling_params import SamplingParams


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("overlap", [True, False])
def test_join_and_leave_match_isolated_greedy(tiny_llama, oracle, overlap):
    engine = make_engine(tiny_llama, overlap=overlap, max_batch_size=4)
    prompts = _prompts(7, seed=overlap)
    max_tokens = [12, 30, 5, 22, 17, 9, 26]
    join_at = [0, 0, 1, 3, 3, 8, 15]
    col, want, arrivals = Collected(), {}, {}
    for i, (p, mt, at) in enumerate(zip(prompts, max_tokens, join_at)):
        params = SamplingParams(temperature=0, max_tokens=mt)
        ref = oracle(p, params)
        want[f"r{i}"] = ref
        arrivals.setdefault(at, []).append(
            lambda i=i, p=p, ref=ref, params=params: submit(
                engine, col, f"r{i}", p, ref.token_ids[0], params, with_kv=i % 2 == 0
            )
        )
    drive(engine, arrivals)
    for rid, ref in want.items():
        assert col.tokens[rid] == ref.token_ids[1:], rid
        assert col.final[rid].finish_reason == ref.finish_reason, rid
    assert engine.graphs.num_eager > 0 and engine.graphs.num_replays == 0  # CPU: eager
    assert_all_free(engine)


def test_preemption_under_tiny_pool_keeps_tokens(tiny_llama, oracle):
    # 4-token blocks; 4 sequences growing to ~45 tokens need ~48 blocks, the pool has 30
    engine = make_engine(tiny_llama, num_blocks=31, max_batch_size=4)
    prompts = _prompts(4, seed=7, lo=6, hi=14)
    col, want = Collected(), {}
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        want[f"p{i}"] = ref = oracle(p, params)
        submit(engine, col, f"p{i}", p, ref.token_ids[0], params, with_kv=i < 2)
    drive(engine, {})
    assert engine.scheduler.num_preemptions > 0
    for rid, ref in want.items():
        assert col.tokens[rid] == ref.token_ids[1:], rid
    assert_all_free(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_sampled_rows_under_preemption_keep_their_tokens_and_slots(tiny_llama, oracle, overlap):
    """Seeded, penalised and logprobs rows preempted and re-admitted (their sampling-state slot
    given back and filled again from their tokens) still give their isolated tokens; every
    slot is free or held by a running sequence at the end; the host waits for a step it has
    just launched only with overlap off; an all-greedy batch only ever replays GREEDY."""
    engine = make_engine(tiny_llama, num_blocks=31, max_batch_size=4, overlap=overlap)
    prompts = _prompts(6, seed=17, lo=6, hi=14)
    col, want = Collected(), {}
    for i, p in enumerate(prompts):
        params = SamplingParams(
            seed=i, top_k=30, repetition_penalty=1.2, frequency_penalty=0.3, max_tokens=30,
            ignore_eos=True, logprobs=1 if i % 2 else None,
        )  # fmt: skip
        want[f"s{i}"] = ref = oracle(p, params)
        submit(engine, col, f"s{i}", p, ref.token_ids[0], params, with_kv=i < 3)
    drive(engine, {})
    assert engine.scheduler.num_preemptions > 0
    for rid, ref in want.items():
        assert col.tokens[rid] == ref.token_ids[1:], rid
    g = engine.graphs
    assert len(g.slots.free) + len(g.slots.owner) == engine.max_batch_size
    assert (engine.sync_reads == 0) if overlap else (engine.sync_reads > 20)
    assert_all_free(engine)
    before = list(g.variant_steps)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    for i, p in enumerate(prompts[:3]):
        submit(engine, col, f"g{i}", p, oracle(p, greedy).token_ids[0], greedy, with_kv=True)
    drive(engine, {})
    assert [a - b for a, b in zip(g.variant_steps, before)][1:] == [0] * 15
    assert_all_free(engine)


def test_abort_frees_blocks_within_one_step(tiny_llama, oracle):
    engine = make_engine(tiny_llama)
    col = Collected()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(3, seed=3)
    for i, p in enumerate(prompts):
        submit(engine, col, f"a{i}", p, 5, params, with_kv=True)
    for _ in range(4):
        engine.step()
    held = len(engine.scheduler.by_id["a1"].block_ids)
    free_before = engine.allocator.num_free
    assert engine.abort("a1") and not engine.abort("a1") and not engine.abort("nope")
    assert engine.allocator.num_free == free_before + held
    engine.step()
    assert col.final["a1"].finish_reason == "abort"
    n_before = len(col.tokens["a0"])
    engine.step()
    assert len(col.tokens["a0"]) == n_before + 1  # the others go on
    drive(engine, {})
    assert len(col.tokens["a0"]) == 39 and "a1" not in engine.scheduler.by_id
    assert_all_free(engine)


def test_mixed_sampling_batch_matches_isolated(tiny_llama, oracle):
    """Seeded random, logprobs, penalised, biased and min_tokens rows are sampled on the device
    in one step next to plain greedy rows (fp32 here); each equals its isolated generation
    (token 0 sampled there too: the prefill -> decode hand-over), the host never waits for a
    step it has just launched, and another seed gives other tokens."""
    engine = make_engine(tiny_llama)
    prompts = _prompts(8, seed=11)
    params = [
        SamplingParams(temperature=0, max_tokens=14),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=14),
        SamplingParams(temperature=0, max_tokens=10, logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, seed=99, repetition_penalty=1.3, max_tokens=12),
        SamplingParams(min_p=0.1, seed=5, frequency_penalty=0.7, presence_penalty=-0.5),
        SamplingParams(temperature=1.5, logit_bias={9: 4.0, 17: -50.0}, seed=6, max_tokens=11),
        SamplingParams(temperature=0.6, min_tokens=8, max_tokens=9, seed=7, logprobs=3),
        SamplingParams(top_k=3, top_p=0.5, seed=8, max_tokens=13),
    ]
    col, want = Collected(), {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        want[f"m{i}"] = ref = oracle(p, sp)
        submit(engine, col, f"m{i}", p, ref.token_ids[0], sp, with_kv=True)
    drive(engine, {})
    for rid, ref in want.items():
        assert col.tokens[rid] == ref.token_ids[1:], rid
    lps = col.logprobs["m2"]
    assert [lp.token_id for lp in lps] == want["m2"].token_ids[1:]
    assert all(len(lp.top) == 2 for lp in lps)
    for got, ref in zip(lps, want["m2"].logprobs[1:]):
        assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)
    assert engine.sync_reads == 0 and engine.graphs.variant_steps[GREEDY] == 0
    assert sum(engine.graphs.variant_steps) > 10
    other = oracle(prompts[1], params[1].model_copy(update={"seed": 4321}))
    assert other.token_ids != want["m1"].token_ids
    assert_all_free(engine)


def test_stop_token_string_and_first_token_finish(tiny_llama, oracle):
    engine = make_engine(tiny_llama)
    [p] = _prompts(1, seed=5)
    base = oracle(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop_tok = base.token_ids[6]
    cases = {  # rid: (params, expected stop_reason)
        "tok": (
            SamplingParams(
                temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok]
            ),
            stop_tok,
        ),
        "one": (
            SamplingParams(temperature=0, max_tokens=1),
            None,
        ),  # the first token already ends it
    }
    if len(base.text) >= 6:  # stop strings are the servicer's (stop_strings.py): the engine
        stop_str = base.text[3:6]  # thread runs on past them, as if there were none
        cases["str"] = (
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_str]),
            None,
        )
    col = Collected()
    for rid, (sp, _) in cases.items():
        submit(engine, col, rid, p, base.token_ids[0], sp, with_kv=False)
    drive(engine, {})
    for rid, (sp, reason) in cases.items():
        ref = oracle(p, sp.model_copy(update={"stop": ()}))
        assert col.tokens.get(rid, []) == ref.token_ids[1:], rid
        assert col.final[rid].finish_reason == ref.finish_reason, rid
        assert col.final[rid].stop_reason == (reason if ref.finish_reason == "stop" else None), rid
    assert "str" in cases and col.final["str"].finish_reason == "length"
    assert_all_free(engine)


def test_min_tokens_and_logit_bias_end_to_end(tiny_llama, oracle):
    """EOS biased +100 comes right after min_tokens tokens (banned before); a +100 bias on one
    token at temperature 1 makes every token that one. Offline and decode engine agree."""
    engine = make_engine(tiny_llama)
    eos = engine.eos[0]
    [p] = _prompts(1, seed=21)
    forced = 77
    cases = {
        f"min{k}": SamplingParams(max_tokens=12, min_tokens=k, logit_bias={eos: 100}, seed=k)
        for k in (1, 4, 9)
    }
    cases["bias"] = SamplingParams(max_tokens=10, temperature=1.0, logit_bias={forced: 100})
    col, want = Collected(), {}
    for rid, sp in cases.items():
        want[rid] = ref = oracle(p, sp)
        submit(engine, col, rid, p, ref.token_ids[0], sp, with_kv=True)
    drive(engine, {})
    for k in (1, 4, 9):
        ref = want[f"min{k}"]
        assert len(ref.token_ids) == k + 1 and ref.token_ids[-1] == eos, ref.token_ids
        assert eos not in ref.token_ids[:k] and ref.finish_reason == "stop"
    assert want["bias"].token_ids == [forced] * 10 and want["bias"].finish_reason == "length"
    for rid, ref in want.items():
        assert col.tokens[rid] == ref.token_ids[1:], rid
        assert col.final[rid].finish_reason == ref.finish_reason, rid
    assert_all_free(engine)


def test_engine_loop_reserve_admit_and_release_blocks(tiny_llama, oracle):
    """The KV-transfer seam through the engine thread: reserve blocks, fill them (here a
    local prefill stands in for the pull), submit with them; unused reservations go back."""
    import threading

    from splitserve.decode_worker.engine_loop import EngineLoop
    from splitserve.decode_worker.sequence import DecodeInput
    from splitserve.engine.model_runner import PrefillChunk

    engine = make_engine(tiny_llama)
    loop = EngineLoop(engine)
    loop.start()
    try:
        [p] = _prompts(1, seed=21)
        params = SamplingParams(temperature=0, max_tokens=9)
        ref = oracle(p, params)
        blocks = loop.reserve_blocks(-(-len(p) // 4)).result(5)
        spare = loop.reserve_blocks(3).result(5)
        assert loop.reserve_blocks(10_000).result(5) is None
        engine.runner.prefill([PrefillChunk(p, 0, blocks)])  # the pull's stand-in (before submit)
        col, done = Collected(), threading.Event()
        sink = col.sink("kv")
        loop.submit(
            DecodeInput("kv", p, ref.token_ids[0], params),
            lambda out: (sink(out), out.finished and done.set()),
            blocks,
        )
        loop.release_blocks(spare)
        assert done.wait(10)
        assert col.tokens["kv"] == ref.token_ids[1:]
        assert loop.abort("kv").result(5) is False
    finally:
        loop.stop()
    assert_all_free(engine)


def test_an_idle_engine_reports_reserved_and_released_blocks(tiny_llama):
    """GetLoad's snapshot follows reservations and releases while no step runs: a pull cancelled
    on an idle worker once left its blocks reported held until the next request's step."""
    from splitserve.decode_worker.engine_loop import EngineLoop

    engine = make_engine(tiny_llama)
    loop = EngineLoop(engine)
    loop.start()
    try:
        total = engine.load.total_blocks
        ids = loop.reserve_blocks(3).result(5)
        assert engine.load.free_blocks == total - 3
        loop.release_blocks(ids)
        loop.call(lambda: None).result(5)  # after the release, on the engine thread
        assert engine.load.free_blocks == total
    finally:
        loop.stop()
    assert_all_free(engine)


def test_waiting_kv_holders_cannot_starve_the_queue_head(tiny_llama, oracle):
    """A recompute-needing head of the queue gets room from waiting KV holders when nothing
    runs, instead of spinning forever."""
    from decode_helpers import prefill_into_engine

    from splitserve.decode_worker.sequence import DecodeInput

    engine = make_engine(tiny_llama, num_blocks=13, max_batch_size=4)  # 12 usable 4-token blocks
    prompts = _prompts(3, seed=31, lo=18, hi=19)  # 19 tokens: 5 blocks each
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    refs = [oracle(p, params) for p in prompts]
    col = Collected()
    engine.submit(DecodeInput("head", prompts[0], refs[0].token_ids[0], params), col.sink("head"))
    for i in (1, 2):  # they hold 10 of the 12 blocks while waiting behind the head
        engine.admit(
            DecodeInput(f"kv{i}", prompts[i], refs[i].token_ids[0], params),
            prefill_into_engine(engine, prompts[i]),
            col.sink(f"kv{i}"),
        )
    drive(engine, {}, max_steps=200)
    for i, rid in enumerate(("head", "kv1", "kv2")):
        assert col.tokens[rid] == refs[i].token_ids[1:], rid
    recomputed = engine.metrics.registry.get_sample_value(
        "splitserve_decode_recomputed_tokens_total"
    )
    assert recomputed >= 2 * 19  # the head, and kv2 whose KV was given back
    assert_all_free(engine)


def test_blocks_reserved_for_a_pull_make_the_engine_wait_not_fail(tiny_llama, oracle):
    """A running request preempted for want of blocks that pulls hold (reserved, neither
    admitted nor released yet) waits for them: the engine once took "requests wait, nothing
    runs or is in flight" for a stalled scheduler and stopped serving."""
    import threading
    import time

    from splitserve.decode_worker.engine_loop import EngineLoop
    from splitserve.decode_worker.sequence import DecodeInput
    from splitserve.engine.model_runner import PrefillChunk

    engine = make_engine(tiny_llama, num_blocks=13, max_batch_size=4)  # 12 usable 4-token blocks
    loop = EngineLoop(engine)
    loop.start()
    try:
        [p] = _prompts(1, seed=41, lo=18, hi=19)  # 19 tokens: 5 blocks, growing to 8
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        ref = oracle(p, params)
        blocks = loop.reserve_blocks(5).result(5)
        engine.runner.prefill([PrefillChunk(p, 0, blocks)])  # the pull's stand-in
        spare = loop.reserve_blocks(6).result(5)  # another pull's: one block left for A
        assert spare is not None
        col, done = Collected(), threading.Event()
        sink = col.sink("A")
        loop.submit(
            DecodeInput("A", p, ref.token_ids[0], params),
            lambda out: (sink(out), out.finished and done.set()),
            blocks,
        )
        deadline = time.monotonic() + 30
        while not engine.blocked and loop.fatal is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.fatal is None and engine.blocked  # preempted, waiting for the reservation
        loop.release_blocks(spare)  # that pull failed: A gets the blocks, is recomputed
        assert done.wait(30)
        assert col.tokens["A"] == ref.token_ids[1:]
        assert loop.fatal is None
    finally:
        loop.stop()
    assert_all_free(engine)
