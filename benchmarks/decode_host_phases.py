"""Where a decode step's host time goes (`decode.py --constrained` reports it for the largest
batch): the engine's own methods wrapped with timers for one run, in ms per step. Phases nest
(a step's launch contains the forward's and the sampling's enqueue, the masks' fill and the
rows read while the forward runs) and rows read beside the fill run on a helper thread, so the
columns do not sum to the step; `read` includes waiting for the device."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager


class Phases:
    """Seconds and calls per phase, filled while `host_phases` is active."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def timed(self, name: str, fn: Callable) -> Callable:
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        return wrapper

    def ms_per_step(self) -> dict[str, float]:
        steps = max(self.calls.get("step", 0), 1)
        return {k: round(v * 1e3 / steps, 4) for k, v in self.seconds.items()}


@contextmanager
def host_phases(engine):
    """Yields a `Phases` that the engine's methods fill until the block ends."""
    g = engine.graphs
    spots = {
        "step": (engine, "step"),
        "schedule": (engine.scheduler, "schedule"),
        "launch": (g, "launch"),
        "forward_enqueue": (g, "run_forward"),
        "read_incl_device_wait": (g, "read"),
        "consume_tokens": (engine, "_advance_matchers"),
        "mask_fill_incl_rows_beside": (g.masks, "start"),
        "mask_copy": (g.masks, "finish"),
        "sampling_enqueue": (g, "run_sample"),
        "accept_rows": (engine, "_accept_rows"),
        "snapshot": (engine, "_snapshot"),
    }
    phases = Phases()
    saved = []
    for name, (obj, attr) in spots.items():
        saved.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, phases.timed(name, getattr(obj, attr)))
    try:
        yield phases
    finally:
        for obj, attr, old in saved:
            if old is None:
                delattr(obj, attr)  # back to the class's method
            else:
                setattr(obj, attr, old)
