"""worker/gc_pauses.py: the start-up heap frozen out of the collector, collection pauses
counted and exported."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from splitserve.worker.gc_pauses import (
    FREEZE_OFF_ENV,
    GcPauseCollector,
    freeze_startup_heap,
    then_freeze,
    unfreeze_heap,
)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_moves_the_live_heap_out_and_unfreeze_gives_it_back(monkeypatch):
    monkeypatch.delenv(FREEZE_OFF_ENV, raising=False)
    gc.unfreeze()
    kept = _Cycle()  # alive at the freeze: frozen, so a collection no longer visits it
    try:
        frozen, _ = freeze_startup_heap()
        # (>=: a leftover thread of an earlier in-process worker may freeze a few more)
        assert gc.get_freeze_count() >= frozen > 1000
        assert all(o is not kept for o in gc.get_objects())
        freeze_startup_heap()  # a second worker in this process
        unfreeze_heap()
        assert gc.get_freeze_count() > 0  # still frozen: the other worker runs
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0
    assert any(o is kept for o in gc.get_objects())  # collectable again
    unfreeze_heap()  # more stops than freezes: nothing happens


def test_the_freeze_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(FREEZE_OFF_ENV, "1")
    gc.unfreeze()
    assert freeze_startup_heap() == (0, 0.0) and gc.get_freeze_count() == 0


def test_collections_are_timed_by_generation_and_exported():
    registry = CollectorRegistry()
    pauses = GcPauseCollector(registry)
    gc.disable()  # only the collections below (explicit ones still call the callbacks)
    try:
        before = pauses.count[2]
        for _ in range(10):
            _Cycle()
        gc.collect()  # a full collection
        gc.collect(0)
        assert pauses.count[2] == before + 1 and pauses.count[0] >= 1
        assert pauses.seconds[2] > 0 and pauses.max_s[2] > 0
        text = generate_latest(registry).decode()
        assert 'splitserve_gc_collections_total{generation="2"}' in text
        assert (
            registry.get_sample_value("splitserve_gc_pause_seconds_total", {"generation": "2"})
            == pauses.seconds[2]
        )
        assert (
            registry.get_sample_value("splitserve_gc_pause_max_seconds", {"generation": "2"})
            == pauses.max_s[2]
        )
    finally:
        gc.enable()
        pauses.close()
    count = pauses.count[2]
    gc.collect()
    assert pauses.count[2] == count  # closed: no longer called


def test_a_registry_that_refuses_the_collector_gets_no_callback_behind():
    registry = CollectorRegistry()
    first = GcPauseCollector(registry)
    try:
        callbacks = len(gc.callbacks)
        with pytest.raises(ValueError, match="Duplicated"):
            GcPauseCollector(registry)  # the same names twice
        assert len(gc.callbacks) == callbacks
    finally:
        first.close()


def test_a_followers_zero_kv_freezes_after_it_runs(monkeypatch):
    monkeypatch.delenv(FREEZE_OFF_ENV, raising=False)
    gc.unfreeze()
    seen: list[int] = []
    try:
        then_freeze(lambda: seen.append(gc.get_freeze_count()))()
        assert seen == [0] and gc.get_freeze_count() > 1000  # zeroed first, then frozen
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0
