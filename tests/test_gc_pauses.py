"""worker/gc_pauses.py: the start-up heap frozen out of the collector, collection pauses
counted and exported."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, generate_latest

from splitserve.worker.gc_pauses import GcPauseCollector, freeze_startup_heap, unfreeze_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_moves_the_live_heap_out_and_unfreeze_gives_it_back():
    gc.unfreeze()
    try:
        frozen, took = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 1000 and took >= 0
        # what was alive is skipped by later collections: generation 2 holds only newer objects
        assert len(gc.get_objects(generation=2)) < frozen
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0


def test_collections_are_timed_by_generation_and_exported():
    registry = CollectorRegistry()
    pauses = GcPauseCollector(registry)
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
        pauses.close()
    count = pauses.count[2]
    gc.collect()
    assert pauses.count[2] == count  # closed: no longer called
    pauses.mark_serving()  # what start-up collected is not counted as serving's
    assert pauses.count == [0, 0, 0] and pauses.max_s == [0.0, 0.0, 0.0]
