"""KV leases: a finished prefill's blocks stay pinned until the decode side is done.

    Prefill done ──▶ grant(request, blocks, ttl) ──▶ lease held (blocks keep their reference)
                        │ ReleaseLease(lease_id)          ─┐
                        │ Abort(request_id)                ├─▶ popped: the caller frees the blocks
                        │ ttl passed (pop_expired)        ─┘

The table only keeps books (a monotonic clock and a heap of expiries); the engine frees
the blocks it gets back, so a lease never frees anything twice: each lease is popped once.
"""

from __future__ import annotations

import heapq
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    ttl_s: float
    expires_at: float  # on the table's monotonic clock
    expires_at_unix_ms: int


class LeaseTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._expiry: list[tuple[float, str]] = []  # heap; stale entries are skipped
        self._expired: OrderedDict[str, None] = (
            OrderedDict()
        )  # recent expiries, to tell a late pull why
        self.on_grant: Callable[[], None] | None = None  # the KV listener's expect_pull

    def expired_recently(self, lease_id: str) -> bool:
        return lease_id in self._expired

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def grant(
        self, request_id: str, block_ids: tuple[int, ...], num_tokens: int, ttl_s: float
    ) -> Lease:
        now = self._clock()
        lease = Lease(
            uuid.uuid4().hex,
            request_id,
            block_ids,
            num_tokens,
            ttl_s,
            now + ttl_s,
            int((time.time() + ttl_s) * 1000),
        )
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        if self.on_grant is not None:
            self.on_grant()
        return lease

    def pop(self, lease_id: str) -> Lease | None:
        """Removes a lease; None when unknown, expired or already released."""
        return self._leases.pop(lease_id, None)

    def pop_request(self, request_id: str) -> list[Lease]:
        """Removes every lease of a request (Abort)."""
        ids = [lid for lid, lease in self._leases.items() if lease.request_id == request_id]
        return [self._leases.pop(lid) for lid in ids]

    def pop_expired(self) -> list[Lease]:
        now = self._clock()
        out = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lid = heapq.heappop(self._expiry)
            lease = self._leases.pop(lid, None)
            if lease is not None:
                out.append(lease)
                self._expired[lid] = None
                if len(self._expired) > 4096:
                    self._expired.popitem(last=False)
        return out

    def pop_all(self) -> list[Lease]:
        out = list(self._leases.values())
        self._leases.clear()
        self._expiry.clear()
        return out

    def seconds_to_next_expiry(self) -> float | None:
        """Time until the earliest live lease expires (>= 0), None when no lease is held."""
        while self._expiry and self._expiry[0][1] not in self._leases:
            heapq.heappop(self._expiry)  # released earlier
        if not self._expiry:
            return None
        return max(0.0, self._expiry[0][0] - self._clock())
