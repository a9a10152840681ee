"""The retry hint of a full queue (request/retry_hint.py) and where the workers' schedulers give
one: a full queue gets the time it takes to drain, a request too big for the pool gets none."""

from __future__ import annotations

import grpc
import pytest

from splitserve.decode_worker.scheduler import DecodeScheduler
from splitserve.decode_worker.sequence import DecodeSequence
from splitserve.request.block_allocator import BlockAllocator
from splitserve.request.errors import RequestError
from splitserve.request.retry_hint import (
    MAX_RETRY_AFTER_S,
    MIN_RETRY_AFTER_S,
    WINDOW_S,
    QueueDrainRate,
)
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.stop_checker import StopChecker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_hint_is_the_drain_time_at_the_recent_admission_rate_within_bounds():
    clock = Clock()
    rate = QueueDrainRate(clock=clock)
    assert rate.retry_after_s(5) == MAX_RETRY_AFTER_S  # nothing admitted yet: nothing moves
    for second in range(1001, 1011):  # 2 admissions a second over the whole window
        clock.now = second
        rate.admitted(2)
    clock.now += 0.5
    assert rate.retry_after_s(10) == pytest.approx(5.0)  # 10 waiting at 2/s
    assert rate.retry_after_s(1) == MIN_RETRY_AFTER_S  # 0.5 s, rounded up to HTTP's 1 s
    assert rate.retry_after_s(1000) == MAX_RETRY_AFTER_S  # 500 s, capped
    clock.now += WINDOW_S + 1  # nothing admitted for a whole window
    assert rate.retry_after_s(10) == MAX_RETRY_AFTER_S


def test_a_young_queue_measures_over_its_age_and_memory_stays_bounded():
    clock = Clock()
    rate = QueueDrainRate(clock=clock)
    clock.now += 2.0
    rate.admitted(8)  # 8 in the 2 s since it started: 4/s, not 8 per 10 s
    assert rate.retry_after_s(12) == pytest.approx(3.0)
    for _ in range(10_000):  # a burst of admissions costs one slot per second
        clock.now += 0.001
        rate.admitted()
    assert len(rate._seconds) <= WINDOW_S + 1


def _sequence(rid: str, prompt_len: int, max_tokens: int) -> DecodeSequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    stop = StopChecker(params, (), 256, prompt_len, match_stop_strings=False)
    return DecodeSequence(rid, [1] * prompt_len, params, stop, lambda out: None, [5])


def test_decode_queue_full_has_a_hint_and_too_big_for_the_pool_none():
    # 15 usable blocks of 4 tokens: 60 tokens at most; a queue of 2
    sched = DecodeScheduler(BlockAllocator(16), 4, 8, 256, 2, 64)
    for rid in ("a", "b"):
        sched.add(_sequence(rid, 4, 4))
    with pytest.raises(RequestError) as full:
        sched.add(_sequence("c", 4, 4))
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "decode queue is full" in full.value.message
    assert MIN_RETRY_AFTER_S <= full.value.retry_after_s <= MAX_RETRY_AFTER_S
    with pytest.raises(RequestError) as too_big:  # even with the queue full: waiting cannot help
        sched.add(_sequence("d", 4, 60))
    assert too_big.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "cache.num_blocks" in too_big.value.message and too_big.value.retry_after_s is None
