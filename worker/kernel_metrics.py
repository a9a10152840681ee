"""The kernel-compilation counter (kernels/compile_counter.py) as a Prometheus metric, split
into the compilations before SERVING (warm-up) and after (a stall some request waited on).

    splitserve_kernel_compilations_total{phase="startup"}   warm-up's compilations
    splitserve_kernel_compilations_total{phase="serving"}   must stay 0

The count is per process: workers sharing a test process share it.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from splitserve.kernels import compile_counter

log = logging.getLogger(__name__)


class KernelCompileMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.hook = compile_counter.install()
        self._at_serving: int | None = None  # the count when health went SERVING
        self._seen: dict[str, int] = {}
        registry.register(self)

    def mark_serving(self) -> int:
        """Call once health says SERVING; returns warm-up's compilations."""
        self._at_serving = compile_counter.compilations()
        self._seen = compile_counter.by_kernel()
        compile_counter.mark_serving()
        return self._at_serving

    def mark_stopped(self) -> None:
        """Serving ended (a test process may build the next worker: its warm-up is no stall)."""
        compile_counter.mark_serving(False)

    @property
    def serving(self) -> int:
        """Compilations since SERVING (0 before)."""
        if self._at_serving is None:
            return 0
        return compile_counter.compilations() - self._at_serving

    def startup(self) -> int:
        return compile_counter.compilations() if self._at_serving is None else self._at_serving

    def new_since_serving(self) -> dict[str, int]:
        """Kernels compiled while serving, by name: what a warm-up missed."""
        now = compile_counter.by_kernel()
        return {k: n - self._seen.get(k, 0) for k, n in now.items() if n > self._seen.get(k, 0)}

    def collect(self):
        fam = CounterMetricFamily(
            "splitserve_kernel_compilations",
            "Triton kernel compilations (JIT cache misses) in this process; serving must stay 0",
            labels=["phase"],
        )
        fam.add_metric(["startup"], self.startup())
        fam.add_metric(["serving"], self.serving)
        yield fam

    def describe(self):
        return []  # collected lazily: registering must not call collect() before install
