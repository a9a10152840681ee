"""Tensor-parallel prefill worker: the follower ranks, and the lease mirror that feeds them.

    rank 0 (PrefillWorker: gRPC, scheduler, leases)        rank r (this module's process)
    ───────────────────────────────────────────────        ──────────────────────────────
    runner.prefill / zero_kv ── ("prefill", chunks) ─────▶ same forward on its heads' slices
    MirroredLeaseTable.grant ── ("lease_grant", ...) ────▶ MirrorLeaseSource: lease -> blocks
    lease popped (released, expired, aborted) ─("lease_drop")─▶ forgotten (after its pulls end)
    UCX listener: heads [0, h) of the lease ◀── decode ──▶ UCX listener: heads [r*h, (r+1)*h)
    stream hub ── ("stream_add" / "_step" / "_end") ───────▶ its own stream hub (kv_stream_tp.py)

Block ids are rank 0's (every pool has the same number of blocks). A follower's copy of a
lease's blocks stays valid until rank 0 frees them: the drop travels in the same ordered
command stream before any prefill that could reuse them, and a follower runs no forward while
a dropped lease of its own is still being pulled. The decode side pulls rank 0's shard last,
and only its delivery releases the lease (kvtransfer/shards.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

import torch
import torch.distributed as dist

from splitserve.engine.tp_follower import follower_process
from splitserve.kvtransfer.server import LeaseLookupError
from splitserve.prefill_worker.leases import Lease, LeaseTable
from splitserve.protos import kv_pb2
from splitserve.worker.gc_pauses import then_freeze

log = logging.getLogger("splitserve.prefill_worker.tp")

GRANT_WAIT_S = 5.0  # a pull may reach a follower just before rank 0's grant does


class MirroredLeaseTable(LeaseTable):
    """Rank 0's lease table; publishes every grant and every removal to the followers."""

    def __init__(
        self, publish: Callable[[tuple], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(clock)
        self._publish = publish

    def _dropped(self, leases: list[Lease]) -> list[Lease]:
        if leases:
            try:
                self._publish(("lease_drop", [lease.lease_id for lease in leases]))
            except (
                RuntimeError
            ):  # the followers are gone: nothing left to mirror, rank 0 still frees
                log.debug("lease drop not mirrored: the followers are gone")
        return leases

    def grant(
        self, request_id: str, block_ids: tuple[int, ...], num_tokens: int, ttl_s: float
    ) -> Lease:
        lease = super().grant(request_id, block_ids, num_tokens, ttl_s)
        self._publish(("lease_grant", lease.lease_id, lease.request_id, tuple(lease.block_ids)))
        return lease

    def pop(self, lease_id: str) -> Lease | None:
        lease = super().pop(lease_id)
        self._dropped([lease] if lease is not None else [])
        return lease

    def pop_request(self, request_id: str) -> list[Lease]:
        return self._dropped(super().pop_request(request_id))

    def pop_expired(self) -> list[Lease]:
        return self._dropped(super().pop_expired())

    def pop_all(self) -> list[Lease]:
        return self._dropped(super().pop_all())


class MirrorLeaseSource:
    """A follower's leases (kvtransfer.server.LeaseSource): filled by the command thread, read
    by the UCX listener on the event loop."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._leases: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._pins: Counter[str] = Counter()
        self._zombies: set[str] = set()  # dropped by rank 0 while a pull still reads them
        self._gone: OrderedDict[str, None] = OrderedDict()

    # ---- command thread ----------------------------------------------------------------------
    def grant(self, lease_id: str, request_id: str, blocks: tuple[int, ...]) -> None:
        with self._cv:
            self._leases[lease_id] = (request_id, tuple(blocks))

    def drop(self, lease_ids: list[str]) -> None:
        with self._cv:
            for lid in lease_ids:
                if self._leases.pop(lid, None) is not None and self._pins[lid]:
                    self._zombies.add(lid)
                self._gone[lid] = None
                if len(self._gone) > 4096:
                    self._gone.popitem(last=False)

    def wait_quiet(self) -> None:
        """Before a forward: no block of a dropped lease may still be read by a pull."""
        with self._cv:
            self._cv.wait_for(lambda: not self._zombies)

    # ---- event loop (UCX listener) -------------------------------------------------------------
    def blocks(self, lease_id: str) -> tuple[int, ...] | None:
        """The lease's blocks while rank 0 holds it (a streamed pull's late attach)."""
        with self._cv:
            entry = self._leases.get(lease_id)
        return None if entry is None else entry[1]

    async def begin_pull(self, lease_id: str, request_id: str) -> list[int]:
        deadline = time.monotonic() + GRANT_WAIT_S
        while True:
            with self._cv:
                entry = self._leases.get(lease_id)
                if entry is not None:
                    if entry[0] != request_id:
                        raise LeaseLookupError(
                            kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN,
                            "the lease belongs to another request",
                        )
                    self._pins[lease_id] += 1
                    return list(entry[1])
                gone = lease_id in self._gone
            if gone or time.monotonic() > deadline:
                raise LeaseLookupError(
                    kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN,
                    "no such lease on this tensor-parallel rank (released, expired, "
                    "aborted or never granted)",
                )
            await asyncio.sleep(0.01)

    def end_pull(self, lease_id: str, delivered: bool) -> None:
        """Unpins; the lease itself is rank 0's to release (its shard is pulled last)."""
        with self._cv:
            self._pins[lease_id] -= 1
            if self._pins[lease_id] <= 0:
                del self._pins[lease_id]
                self._zombies.discard(lease_id)
                self._cv.notify_all()


def exchange_ports(tp, port: int) -> list[int]:
    """Every rank's UCX listener port, by rank (rank 0 may pass 0 and fill in its own later).
    Plain int64 tensors: nothing a rank receives over the group is unpickled."""
    ports = [torch.zeros(1, dtype=torch.int64) for _ in range(tp.size)]
    dist.all_gather(ports, torch.tensor([port], dtype=torch.int64), group=tp.cpu_group)
    return [int(p) for p in ports]


@follower_process
def prefill_follower_main(rank: int, size: int, launch, cfg) -> None:
    """Entry of follower rank `rank` of a prefill worker (`launch`: tp_channel.FollowerLaunch,
    `cfg`: its PrefillWorkerConfig)."""
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.parallel import destroy_tp
    from splitserve.engine.tp_follower import join_as_follower

    tp = join_as_follower(rank, size, launch, cfg.engine)
    try:
        asyncio.run(_serve(tp, ModelRunner(cfg.engine, tp), cfg))
    finally:
        destroy_tp(tp)


async def _serve(tp, runner, cfg) -> None:
    from splitserve.engine.tp_follower import follow
    from splitserve.kvtransfer.descriptor import PoolSpec
    from splitserve.kvtransfer.server import KvTransferServer

    leases = MirrorLeaseSource()
    spec = PoolSpec.of(runner.kv_cache, runner.compat_hash, runner.model_config.num_key_value_heads)
    server = KvTransferServer(
        runner.kv_cache,
        spec,
        leases,
        cfg.kv_transfer.for_rank(tp.rank),
        host=cfg.server.host,  # as rank 0's: a loopback worker's KV ports stay on loopback
        drain_strays=True,  # this process's UCX serves this listener only
    )
    port = await server.start()
    exchange_ports(tp, port)

    def forward(fn: Callable) -> Callable:
        def run(*args) -> None:
            leases.wait_quiet()
            fn(*args)

        return run

    handlers = {
        "prefill": forward(runner.prefill),
        "zero_kv": then_freeze(forward(runner.zero_kv)),  # warm-up's end (worker/gc_pauses.py)
        "lease_grant": leases.grant,
        "lease_drop": leases.drop,
    }
    if cfg.kv_transfer.streaming:  # this rank streams its own heads (kv_stream_tp.py)
        from splitserve.prefill_worker.kv_stream_tp import follower_stream_handlers

        stream = follower_stream_handlers(runner, leases, server, spec, cfg, tp.rank)
        prefill, done = handlers["prefill"], stream.pop("prefill_done")

        def prefill_then_tell(*args) -> None:
            try:
                prefill(*args)
            finally:
                done()

        handlers.update(stream, prefill=prefill_then_tell)
    try:
        await asyncio.to_thread(follow, tp, runner, handlers)
    finally:
        await server.close()
