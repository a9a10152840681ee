"""Chunked prefill in the decode worker (colocated prompts, recompute): each engine step
computes at most `prefill_chunk_tokens` local-prefill tokens before its decode, so running
sequences keep stepping while a long prompt is computed; the tokens equal isolated
generation; an abort mid-prefill frees every block."""

from __future__ import annotations

import random

import pytest
from decode_helpers import Collected, assert_all_free, drive, make_engine

from splitserve.decode_worker.scheduler import DecodeScheduler
from splitserve.decode_worker.sequence import DecodeInput, DecodeSequence
from splitserve.request.block_allocator import BlockAllocator
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.stop_checker import StopChecker


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 500) for _ in range(n - 1)]


def _seq(rid: str, n: int) -> DecodeSequence:
    params = SamplingParams(temperature=0, max_tokens=4)
    stop = StopChecker(params, (2,), 256, n, match_stop_strings=False)
    return DecodeSequence(rid, _prompt(n, len(rid)), params, stop, lambda out: None)


def _plan(sched: DecodeScheduler) -> tuple[list[tuple[str, int, int]], list[str]]:
    batch = sched.schedule()
    assert batch is not None
    return [(s.request_id, a, b) for s, a, b in batch.prefill], [s.request_id for s in batch.seqs]


def test_scheduler_splits_the_budget_oldest_first_and_admits_only_with_budget_left():
    alloc = BlockAllocator(64)
    sched = DecodeScheduler(alloc, 4, 8, 256, 16, 8192, prefill_chunk_tokens=8)
    for rid, n in (("a", 10), ("bb", 10), ("ccc", 3)):
        sched.add(_seq(rid, n))
    # step 1: a takes the whole budget; b is not admitted (no budget left), so holds no blocks
    assert _plan(sched) == ([("a", 0, 8)], [])
    assert [s.request_id for s in sched.waiting] == ["bb", "ccc"]
    # step 2: a's last 2 tokens (it joins the decode rows), then b gets the 6 left
    assert _plan(sched) == ([("a", 8, 10), ("bb", 0, 6)], ["a"])
    # step 3: b's last 4, then c whole (3 <= 4 left); both decode in this step
    assert _plan(sched) == ([("bb", 6, 10), ("ccc", 0, 3)], ["a", "bb", "ccc"])
    assert _plan(sched) == ([], ["a", "bb", "ccc"])
    for seq in list(sched.running):
        sched.finish(seq)
    assert alloc.num_free == alloc.num_usable


def test_scheduler_whole_prompts_with_chunking_off():
    alloc = BlockAllocator(64)
    sched = DecodeScheduler(alloc, 4, 8, 256, 16, 12, prefill_chunk_tokens=0)
    for rid, n in (("a", 10), ("bb", 10), ("ccc", 2)):
        sched.add(_seq(rid, n))
    # a whole; b (10 > the 2 tokens of max_recompute_tokens left) waits for the next step
    assert _plan(sched) == ([("a", 0, 10)], ["a"])
    assert _plan(sched) == ([("bb", 0, 10), ("ccc", 0, 2)], ["a", "bb", "ccc"])


def test_preempted_mid_prefill_starts_again():
    alloc = BlockAllocator(64)
    sched = DecodeScheduler(alloc, 4, 8, 256, 16, 8192, prefill_chunk_tokens=4)
    seq = _seq("a", 10)
    sched.add(seq)
    assert _plan(sched) == ([("a", 0, 4)], [])
    assert seq.prefilling and len(seq.block_ids) == 3  # the whole prompt's blocks from admission
    sched._preempt(seq)
    assert not seq.prefilling and not seq.block_ids and alloc.num_free == alloc.num_usable
    assert _plan(sched) == ([("a", 0, 4)], [])


@pytest.mark.parametrize("overlap", [True, False])
def test_running_sequences_step_while_a_long_prompt_prefills(tiny_llama, oracle, overlap):
    chunk = 8
    engine = make_engine(
        tiny_llama, overlap=overlap, max_batch_size=4, num_blocks=128, prefill_chunk_tokens=chunk
    )
    prefilled: list[int] = []  # tokens of each local prefill call
    real_prefill = engine.runner.prefill

    def counting_prefill(chunks):
        prefilled.append(sum(len(c.token_ids) for c in chunks))
        return real_prefill(chunks)

    engine.runner.prefill = counting_prefill
    short, long = _prompt(5, 1), _prompt(90, 2)
    sp_short = SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)
    sp_long = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    col, step_of = Collected(), {"a": [], "b": []}
    steps = [0]

    def sink(rid):
        put = col.sink(rid)

        def record(out):
            step_of[rid].extend([steps[0]] * len(out.token_ids))
            put(out)

        return record

    def submit(rid, prompt, sp):
        engine.submit(DecodeInput(rid, prompt, None, sp), sink(rid))

    real_step = engine.step

    def counted_step():
        steps[0] += 1
        real_step()

    engine.step = counted_step
    drive(
        engine, {0: [lambda: submit("a", short, sp_short)], 4: [lambda: submit("b", long, sp_long)]}
    )
    assert col.tokens["a"] == oracle(short, sp_short).token_ids
    assert col.tokens["b"] == oracle(long, sp_long).token_ids
    assert max(prefilled) <= chunk and sum(prefilled) == len(short) + len(long)
    # b's prompt needs ceil(90 / 8) = 12 steps; a got a token in every one of them
    b_first = step_of["b"][0]
    assert b_first - 5 >= 90 // chunk
    during = [s for s in step_of["a"] if 5 <= s < b_first]
    assert len(during) >= b_first - 5 - 1 and len(set(during)) == len(during)
    assert_all_free(engine)


def test_abort_mid_prefill_frees_its_blocks(tiny_llama):
    engine = make_engine(tiny_llama, prefill_chunk_tokens=4, overlap=False)
    col = Collected()
    sp = SamplingParams(temperature=0, max_tokens=5)
    engine.submit(DecodeInput("x", _prompt(40, 5), None, sp), col.sink("x"))
    engine.step()
    engine.step()
    seq = engine.scheduler.by_id["x"]
    assert seq.prefilling and seq.prefill_pos == 8 and not col.tokens["x"]
    assert engine.abort("x")
    assert col.final["x"].finish_reason == "abort"
    assert not engine.has_work
    assert_all_free(engine)
