"""Python's garbage collector around serving: the start-up heap frozen, collection pauses counted.

A full (generation 2) collection walks every live container object. After start-up a worker
holds the model's modules, the captured graphs' Python side, gRPC, protobuf and tokenizer
objects, and the first full collection after SERVING lands on a request: a one-off stall of
milliseconds that no kernel accounts for. So once warm-up is done the heap is collected and
frozen (`gc.freeze()`: what is alive moves to a permanent generation that collections skip), as
vLLM does after its warm-up (`freeze_gc_heap`) and SGLang offers (`freeze_gc`). Later
collections then walk only what serving allocated.

`GcPauseCollector` times every collection (gc.callbacks) into plain counters and hands them to
the metrics endpoint at scrape time (the worker creates it at SERVING), so a stall can be
matched with a pause:
splitserve_gc_pause_seconds_total / splitserve_gc_collections_total / splitserve_gc_pause_max_seconds,
each by generation. (No prometheus metric is touched inside the callback: a collection can start
while this thread holds a metric's lock.)
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

FREEZE_OFF_ENV = "SPLITSERVE_NO_GC_FREEZE"  # "1": leave the heap as it is (an A/B, a debug run)


_freezes = 0  # workers of this process that froze the heap and have not stopped


def freeze_startup_heap() -> tuple[int, float]:
    """Collects, then freezes what is left; returns (objects frozen, seconds it took)."""
    global _freezes
    if os.environ.get(FREEZE_OFF_ENV) == "1":
        return 0, 0.0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    _freezes += 1
    return gc.get_freeze_count(), time.perf_counter() - t0


def unfreeze_heap() -> None:
    """A worker that froze the heap stopped: once none is left in this process (tests and
    benchmarks run workers in-process), the frozen objects go back to the collector."""
    global _freezes
    if _freezes == 0:
        return
    _freezes -= 1
    if _freezes == 0:
        gc.unfreeze()


def then_freeze(fn: Callable[[], None]) -> Callable[[], None]:
    """A tensor-parallel follower's `zero_kv` handler: the pool zeroed is the last step of every
    worker's warm-up (rank 0 mirrors it), so the follower freezes its heap right after; a full
    collection there would stall every rank's lockstep step."""

    def run(*args) -> None:
        fn(*args)
        freeze_startup_heap()

    return run


class GcPauseCollector:
    def __init__(self, registry=None) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self._t0: float | None = None
        if registry is not None:  # first: a registry that refuses it leaves no callback behind
            registry.register(self)
        gc.callbacks.append(self._on_gc)

    def describe(self):
        """Lets a registry check names up front (and serve `?name[]=` scrapes)."""
        return self.collect()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is None:
            return
        took, self._t0 = time.perf_counter() - self._t0, None
        g = min(int(info.get("generation", 2)), 2)
        self.count[g] += 1
        self.seconds[g] += took
        self.max_s[g] = max(self.max_s[g], took)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def collect(self):
        """prometheus_client's collector protocol (called at scrape time)."""
        total = CounterMetricFamily(
            "splitserve_gc_pause_seconds",
            "Time spent in Python garbage collections since SERVING, by generation",
            labels=["generation"],
        )
        runs = CounterMetricFamily(
            "splitserve_gc_collections",
            "Python garbage collections since SERVING, by generation",
            labels=["generation"],
        )
        worst = GaugeMetricFamily(
            "splitserve_gc_pause_max_seconds",
            "The longest Python garbage collection since SERVING, by generation",
            labels=["generation"],
        )
        for g in range(3):
            total.add_metric([str(g)], self.seconds[g])
            runs.add_metric([str(g)], self.count[g])
            worst.add_metric([str(g)], self.max_s[g])
        return [total, runs, worst]
