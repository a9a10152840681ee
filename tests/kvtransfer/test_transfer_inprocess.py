"""KV pulls over real UCX (TCP loopback on CPU): a listener and a client in one event loop,
two separate pools. Worker-level hand-over between processes is tested with the workers."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
import torch

from splitserve.kvtransfer.client import KvTransferClient
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.descriptor import PoolSpec, make_handle
from splitserve.kvtransfer.errors import KvTransferError
from splitserve.kvtransfer.pull_stats import PHASES
from splitserve.kvtransfer.server import KvTransferServer, LeaseLookupError, TransferFaults
from splitserve.protos import kv_pb2

SHAPE = (2, 2, 80, 16, 2, 64)  # 32 KiB per block (fp32)


class Leases:
    def __init__(self):
        self.table: dict[str, list[int]] = {}
        self.expired: set[str] = set()
        self.pulled: list[tuple[str, bool]] = []

    def begin_pull(self, lease_id, request_id):
        if lease_id in self.expired:
            raise LeaseLookupError(kv_pb2.KV_PULL_STATUS_LEASE_EXPIRED, f"lease {lease_id} expired")
        if lease_id not in self.table:
            raise LeaseLookupError(kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN, f"no lease {lease_id}")
        return self.table[lease_id]

    def end_pull(self, lease_id, delivered):
        self.pulled.append((lease_id, delivered))
        if delivered:
            self.table.pop(lease_id, None)


def _pools(dst_block_size=16, dst_hash="h"):
    src = torch.randn(SHAPE)
    dst_shape = (*SHAPE[:3], dst_block_size, *SHAPE[4:])
    dst = torch.zeros(dst_shape)
    return src, PoolSpec.of(src, "h"), dst, PoolSpec.of(dst, dst_hash)


async def _run(
    faults=None,
    dst_block_size=16,
    dst_hash="h",
    blocks=(5, 9, 3, 70, 11, 40, 41, 42),
    cfg=None,
    lease="L1",
    register=True,
):
    cfg = cfg or KvTransferConfig(
        max_message_bytes=2**20, data_timeout_s=3, lease_request_timeout_s=3, checksum="always"
    )
    src, src_spec, dst, dst_spec = _pools(dst_block_size, dst_hash)
    leases = Leases()
    if register:
        leases.table[lease] = list(blocks)
    server = KvTransferServer(src, src_spec, leases, cfg, faults)
    port = await server.start()
    client = KvTransferClient(dst, dst_spec, cfg)
    handle = make_handle(
        src_spec,
        host="127.0.0.1",
        port=port,
        lease_id=lease,
        request_id="r1",
        num_blocks=len(blocks),
        num_tokens=len(blocks) * 16 - 3,
        ttl_s=30,
    )
    dest = [1 + i for i in range(len(blocks))]
    try:
        stats = await client.pull(handle, dest)
        for _ in range(200):  # the listener handles KvPullDone after the client returns
            if leases.pulled:
                break
            await asyncio.sleep(0.01)
        return src, dst, dest, blocks, leases, stats
    finally:
        client.close()
        await server.close()


def test_pull_moves_every_layer_k_and_v_in_few_messages():
    blocks = tuple(range(2, 66))  # 64 blocks = 2 MiB -> 2 messages of 1 MiB
    src, dst, dest, blocks, leases, stats = asyncio.run(_run(blocks=blocks))
    assert torch.equal(dst[:, :, dest], src[:, :, list(blocks)])
    untouched = [b for b in range(SHAPE[2]) if b not in dest]
    assert torch.count_nonzero(dst[:, :, untouched]) == 0
    assert leases.pulled == [("L1", True)] and stats.num_bytes == 64 * 32 * 1024
    # the pull's time by phase: every phase timed, together within the whole pull's time
    assert tuple(stats.phases) == PHASES and min(stats.phases.values()) >= 0
    assert stats.phases["payload"] > 0 and sum(stats.phases.values()) <= stats.seconds + 1e-4


def test_payload_that_is_not_a_multiple_of_the_message_limit():
    blocks = tuple(range(2, 50))  # 48 blocks = 1.5 MiB over a 1 MiB limit: two even pieces
    src, dst, dest, blocks, leases, stats = asyncio.run(_run(blocks=blocks))
    assert torch.equal(dst[:, :, dest], src[:, :, list(blocks)])


def test_cached_endpoint_is_reused_and_recreated_after_the_peer_drops_it():
    cfg = KvTransferConfig(data_timeout_s=3, lease_request_timeout_s=3, connect_timeout_s=2)

    async def main():
        src, spec, dst, dspec = _pools()
        leases = Leases()
        client = KvTransferClient(dst, dspec, cfg)
        server = KvTransferServer(src, spec, leases, cfg)
        port = await server.start()
        seen = []
        try:
            for round_ in range(3):
                for i in range(2):
                    lease = f"L{round_}-{i}"
                    leases.table[lease] = [3, 4]
                    await client.pull(
                        make_handle(
                            spec,
                            host="127.0.0.1",
                            port=port,
                            lease_id=lease,
                            request_id="r1",
                            num_blocks=2,
                            num_tokens=20,
                            ttl_s=30,
                        ),
                        [5, 6],
                    )
                    assert torch.equal(dst[:, :, [5, 6]], src[:, :, [3, 4]])
                    dst.zero_()
                assert (
                    len(client.pool.idle[("127.0.0.1", port)]) == 1
                )  # one endpoint served both pulls
                seen.append(client.pool.idle[("127.0.0.1", port)][0][0])  # (endpoint, made at)
                # the peer drops the connection (a restart, as the client sees it): the cached
                # endpoint is stale, and the next round's first pull must retry on a fresh one
                await server.close_connections()
                await asyncio.sleep(0.2)
            assert len({id(ep) for ep in seen}) == 3  # a new endpoint after each drop
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


def test_unknown_and_expired_leases_fail_cleanly():
    with pytest.raises(KvTransferError) as info:
        asyncio.run(_run(register=False))
    assert info.value.reason == "lease_unknown" and info.value.status == grpc.StatusCode.UNAVAILABLE

    async def expired():
        cfg = KvTransferConfig(data_timeout_s=3, lease_request_timeout_s=3)
        src, spec, dst, dspec = _pools()
        leases = Leases()
        leases.expired.add("old")
        server = KvTransferServer(src, spec, leases, cfg)
        port = await server.start()
        client = KvTransferClient(dst, dspec, cfg)
        try:
            await client.pull(
                make_handle(
                    spec,
                    host="127.0.0.1",
                    port=port,
                    lease_id="old",
                    request_id="r",
                    num_blocks=1,
                    num_tokens=4,
                    ttl_s=1,
                ),
                [1],
            )
        finally:
            client.close()
            await server.close()

    with pytest.raises(KvTransferError) as info:
        asyncio.run(expired())
    assert info.value.reason == "lease_expired"


def test_layout_mismatch_is_failed_precondition_before_any_byte_moves():
    with pytest.raises(KvTransferError) as info:
        asyncio.run(_run(dst_block_size=8))
    assert info.value.status == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size" in str(info.value)
    with pytest.raises(KvTransferError, match="model_compat_hash") as info:
        asyncio.run(_run(dst_hash="other-model"))
    assert info.value.reason == "incompatible"


def test_corrupted_or_truncated_payload_is_detected_and_discarded():
    for faults in (TransferFaults(corrupt_payload=True), TransferFaults(truncate_payload=True)):
        with pytest.raises(KvTransferError, match="checksum") as info:
            asyncio.run(_run(faults=faults))
        assert info.value.reason == "checksum"


def test_dead_peer_and_stalled_peer_time_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    cfg = KvTransferConfig(connect_timeout_s=1)

    async def dead():
        src, spec, dst, dspec = _pools()
        client = KvTransferClient(dst, dspec, cfg)
        try:
            await client.pull(
                make_handle(
                    spec,
                    host="127.0.0.1",
                    port=free_port,
                    lease_id="x",
                    request_id="r",
                    num_blocks=1,
                    num_tokens=1,
                    ttl_s=1,
                ),
                [1],
            )
        finally:
            client.close()

    with pytest.raises(KvTransferError) as info:
        asyncio.run(asyncio.wait_for(dead(), 15))
    assert info.value.reason == "connect"
    stall = KvTransferConfig(data_timeout_s=0.5, lease_request_timeout_s=2)
    with pytest.raises(KvTransferError) as info:
        asyncio.run(_run(faults=TransferFaults(stall_before_payload_s=3), cfg=stall))
    assert info.value.reason == "data_timeout"


def test_a_burst_of_pulls_shares_a_bounded_number_of_endpoints():
    """40 pulls at once: each lands its own blocks, over at most MAX_PER_PEER connections
    (the rest queue for an endpoint instead of connecting all at once)."""
    from splitserve.kvtransfer.endpoint_pool import MAX_PER_PEER

    cfg = KvTransferConfig(data_timeout_s=10, lease_request_timeout_s=10, checksum="always")

    async def main():
        src, spec, dst, dspec = _pools()
        leases = Leases()
        server = KvTransferServer(src, spec, leases, cfg)
        port = await server.start()
        client = KvTransferClient(dst, dspec, cfg)
        peak = 0

        async def pull(i):
            nonlocal peak
            leases.table[f"B{i}"] = [2 + i]
            await client.pull(
                make_handle(
                    spec,
                    host="127.0.0.1",
                    port=port,
                    lease_id=f"B{i}",
                    request_id=f"r{i}",
                    num_blocks=1,
                    num_tokens=16,
                    ttl_s=30,
                ),
                [39 + i],
            )
            peak = max(peak, len(server._handlers))

        try:
            await asyncio.gather(*(pull(i) for i in range(40)))
            assert torch.equal(dst[:, :, 39:79], src[:, :, 2:42])
            assert 1 <= peak <= MAX_PER_PEER, peak
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("src_blocks", "dst_start"),
    [
        (tuple(range(10, 42)), 40),  # both sides one run: pool to pool, no pack or unpack
        (tuple(range(10, 42)), None),  # sender zero-copy, receiver unpacks
        (tuple(range(41, 9, -1)), 40),  # sender packs, receiver lands in its pool directly
    ],
)
def test_slab_framed_pulls_match_whichever_side_is_zero_copy(monkeypatch, src_blocks, dst_start):
    from splitserve.kernels import ops
    from splitserve.kvtransfer import buffers

    monkeypatch.setattr(buffers, "ZERO_COPY_MIN_SLAB_BYTES", 4096)  # 32 blocks: 256 KiB slabs
    calls = []
    for name in ("pack_kv_blocks", "unpack_kv_blocks"):
        real = getattr(ops, name)
        monkeypatch.setattr(
            ops, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k)
        )
    cfg = KvTransferConfig(
        max_message_bytes=2**20, data_timeout_s=5, lease_request_timeout_s=5, checksum="always"
    )
    dest = list(range(dst_start, dst_start + 32)) if dst_start else [3 + 2 * i for i in range(32)]

    async def main(faults=None):
        src, spec, dst, dspec = _pools()
        leases = Leases()
        leases.table["Z"] = list(src_blocks)
        server = KvTransferServer(src, spec, leases, cfg, faults)
        port = await server.start()
        client = KvTransferClient(dst, dspec, cfg)
        handle = make_handle(
            spec,
            host="127.0.0.1",
            port=port,
            lease_id="Z",
            request_id="z",
            num_blocks=32,
            num_tokens=500,
            ttl_s=30,
        )
        try:
            await client.pull(handle, dest)
            return src, dst
        finally:
            client.close()
            await server.close()

    src, dst = asyncio.run(main())
    assert torch.equal(dst[:, :, dest], src[:, :, list(src_blocks)])
    packed = src_blocks != tuple(range(10, 42))
    assert calls == ["pack_kv_blocks"] * packed + ["unpack_kv_blocks"] * (dst_start is None)
    assert buffers.plan_messages(32 * 32 * 1024, 2, 2**20) == 4  # one message per slab
    with pytest.raises(KvTransferError) as info:
        asyncio.run(main(TransferFaults(corrupt_payload=True)))
    assert info.value.reason == "checksum"
