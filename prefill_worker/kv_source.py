"""The prefill engine's leases as the UCX listener sees them (kvtransfer.server.LeaseSource).

The listener runs on the engine's event loop, the thread that owns every piece of engine
state, so no lock is needed. Each pull pins the lease's blocks with one reference of its own:
if the lease expires or is aborted mid-pull, the blocks stay allocated until that pull is done.
Two pulls of one lease at once (a decode worker's retry while its first pull still runs) take
two references and give back two; keyed by lease alone they once took two and gave back one,
and the blocks never returned to the pool.
"""

from __future__ import annotations

import time

from splitserve.kvtransfer.server import LeaseLookupError
from splitserve.protos import kv_pb2


class EngineLeaseSource:
    def __init__(self, engine) -> None:
        self.engine = engine
        self._pinned: dict[str, tuple[tuple[int, ...], int]] = {}  # lease -> (blocks, pulls)
        self._started: set[str] = set()  # leases whose first pull began (dropped at delivery)

    def begin_pull(self, lease_id: str, request_id: str) -> list[int]:
        leases = self.engine.leases
        lease = leases.get(lease_id)
        if lease is None:
            if leases.expired_recently(lease_id):
                raise LeaseLookupError(
                    kv_pb2.KV_PULL_STATUS_LEASE_EXPIRED,
                    "the lease expired before the pull; raise the prefill "
                    "worker's lease_ttl_s or pull sooner",
                )
            raise LeaseLookupError(
                kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN,
                "no such lease (released, aborted or never granted)",
            )
        if request_id != lease.request_id:
            raise LeaseLookupError(
                kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN, "the lease belongs to another request"
            )
        self.engine.cache.allocator.incref(lease.block_ids)
        if lease_id not in self._started:  # the hand-over starts (a concurrent retry: no)
            self._started.add(lease_id)
            granted = lease.expires_at - lease.ttl_s  # the lease table's monotonic clock
            self.engine.metrics.handover_wait_seconds.observe(time.monotonic() - granted)
        _, pulls = self._pinned.get(lease_id, ((), 0))
        self._pinned[lease_id] = (tuple(lease.block_ids), pulls + 1)
        return list(lease.block_ids)

    def pulls_expected(self) -> bool:
        # a streamed pull comes while its prompt is queued or computing, before any lease
        return len(self.engine.leases) > 0 or self.engine.busy

    def end_pull(self, lease_id: str, delivered: bool) -> None:
        blocks, pulls = self._pinned.pop(lease_id, ((), 0))
        if pulls > 1:
            self._pinned[lease_id] = (blocks, pulls - 1)
        if blocks:
            self.engine.cache.free(blocks)
        if delivered or lease_id not in self._pinned:
            self._started.discard(lease_id)
        if delivered and self.engine.leases.get(lease_id) is not None:
            self.engine.release_lease(lease_id)
