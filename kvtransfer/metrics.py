"""Prometheus metrics of the KV transfer path (both sides), registered on the worker's own
registry so they appear on its /metrics next to the engine's."""

from __future__ import annotations

import contextlib
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class KvTransferMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.bytes = Counter(
            "splitserve_kv_transfer_bytes_total",
            "KV payload bytes moved",
            ["direction"],
            registry=registry,
        )
        self.seconds = Histogram(
            "splitserve_kv_transfer_seconds",
            "Pull time, request to unpacked (decode side)",
            registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        )
        self.pull_phase = Histogram(
            "splitserve_kv_pull_phase_seconds",
            "Pull time by phase (decode side; rank 0's shard): connect, request (the control "
            "round trip), ready (engine work queued before it), payload (the wire), land "
            "(checksum + unpack)",
            ["phase"],
            registry=registry,
            buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2),
        )
        self.failures = Counter(
            "splitserve_kv_transfer_failures_total", "Failed pulls", ["reason"], registry=registry
        )
        self.gbps = Gauge(
            "splitserve_kv_transfer_gbps", "Throughput of the last pull in GB/s", registry=registry
        )
        self.sending = Gauge(
            "splitserve_kv_transfer_sending",
            "Pulls answered and not yet done (prefill side)",
            registry=registry,
        )
        self.transports = Gauge(
            "splitserve_ucx_transport_available",
            "UCX transports UCX may use",
            ["transport"],
            registry=registry,
        )

    def log_transports(self) -> list[str]:
        """Logs (and exports) the UCX transports this process may use; initializes UCX, and
        imports what ucxx's progress thread imports when it starts (cuda.core, for the CUDA
        context it makes current): 0.2-0.3 s with the GIL held, which otherwise lands on the
        first requests after SERVING (prefill) or on the first hand-over (decode)."""
        import ucxx

        with contextlib.suppress(Exception):  # (no cuda-core: the thread fails alike later)
            from ucxx._cuda_context import _get_device_class

            _get_device_class()

        transports = sorted(ucxx.get_active_transports())
        for t in transports:
            self.transports.labels(t).set(1)
        logging.getLogger("splitserve.kvtransfer").info(
            "UCX transports available: %s", ", ".join(transports)
        )
        return transports
