"""What one KV pull reports (KvTransferClient.pull): its bytes, its time, and that time by
phase, so a slow hand-over says whether the connect, the control round trip, the wait for the
transfer stream, the wire or the landing took it (also the `splitserve_kv_pull_phase_seconds`
histogram; `benchmarks/kvtransfer.py` prints the medians beside raw ucxx)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# a pull's phases in order (PullStats.phases; the metric's `phase` label): endpoint from the
# pool (or a new connection), the request / reply round trip, the transfer stream ready for
# the payload (queued engine work done), the payload on the wire, the checksum + unpack
PHASES = ("connect", "request", "ready", "payload", "land")


def lap(phases: dict[str, float], name: str, since: float) -> float:
    now = time.perf_counter()
    phases[name] = phases.get(name, 0.0) + now - since
    return now


@dataclass(frozen=True)
class PullStats:
    num_bytes: int
    seconds: float
    # seconds per phase of the last shard's exchange (rank 0's; PHASES), so a slow pull says
    # whether the connect, the control round trip, the stream waits, the wire or the landing
    # took the time
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9
