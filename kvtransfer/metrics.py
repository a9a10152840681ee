"""Prometheus metrics of the KV transfer path (both sides)."""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram

TRANSFER_BYTES = Counter("splitserve_kv_transfer_bytes_total", "KV payload bytes moved", ["direction"])
TRANSFER_SECONDS = Histogram(
    "splitserve_kv_transfer_seconds", "Pull time, request to unpacked (decode side)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
)
TRANSFER_FAILURES = Counter("splitserve_kv_transfer_failures_total", "Failed pulls", ["reason"])
TRANSFER_GBPS = Gauge("splitserve_kv_transfer_gbps", "Throughput of the last pull in GB/s")
UCX_TRANSPORTS = Gauge("splitserve_ucx_transport_available", "UCX transports UCX may use", ["transport"])


def log_transports() -> list[str]:
    """Logs (and exports) the UCX transports this process may use; initializes UCX."""
    import ucxx

    transports = sorted(ucxx.get_active_transports())
    for t in transports:
        UCX_TRANSPORTS.labels(t).set(1)
    logging.getLogger("splitserve.kvtransfer").info("UCX transports available: %s", ", ".join(transports))
    return transports
