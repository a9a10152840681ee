"""The prefill engine's leases as the UCX listener sees them (kvtransfer.server.LeaseSource).

The listener runs on the engine's event loop, the thread that owns every piece of engine
state, so no lock is needed. A pull pins the lease's blocks with an extra reference: if the
lease expires or is aborted mid-pull, the blocks stay allocated until the pack is done.
"""

from __future__ import annotations

from splitserve.kvtransfer.server import LeaseLookupError
from splitserve.protos import kv_pb2


class EngineLeaseSource:
    def __init__(self, engine) -> None:
        self.engine = engine
        self._pinned: dict[str, tuple[int, ...]] = {}

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
        self._pinned[lease_id] = lease.block_ids
        return list(lease.block_ids)

    def pulls_expected(self) -> bool:
        return len(self.engine.leases) > 0

    def end_pull(self, lease_id: str, delivered: bool) -> None:
        blocks = self._pinned.pop(lease_id, ())
        if blocks:
            self.engine.cache.free(blocks)
        if delivered and self.engine.leases.get(lease_id) is not None:
            self.engine.release_lease(lease_id)
