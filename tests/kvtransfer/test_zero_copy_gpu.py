"""Slab-framed pulls between two processes on a GPU (cuda_ipc): the payload goes straight from
the prefill pool to the decode pool where a side's blocks are one run, packed / unpacked where
not; every combination lands the same bytes, and the checksum computed over pool views on the
device matches the sender's."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPE = (4, 2, 300, 16, 2, 64)  # fp32: 8 KiB per (layer, K/V, block), 128 blocks = 1 MiB slabs
N = 128
RUN = list(range(10, 10 + N))
SCATTERED = [12 + 2 * i for i in range(N)]


def _source_pool() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(4321))


class _Leases:
    def begin_pull(self, lease_id, request_id):
        return RUN if lease_id == "run" else SCATTERED

    def end_pull(self, lease_id, delivered):
        pass


def _serve(port_q, stop_q) -> None:
    from splitserve.kvtransfer.config import KvTransferConfig
    from splitserve.kvtransfer.descriptor import PoolSpec
    from splitserve.kvtransfer.server import KvTransferServer

    async def main() -> None:
        pool = _source_pool().cuda()
        server = KvTransferServer(pool, PoolSpec.of(pool, "h"), _Leases(), KvTransferConfig())
        port_q.put(await server.start())
        await asyncio.to_thread(stop_q.get)
        await server.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("lease", "dest"),
    [("run", RUN), ("run", SCATTERED), ("scattered", RUN), ("scattered", SCATTERED)],
)
def test_pool_to_pool_pulls_on_the_gpu(lease, dest):
    from splitserve.kernels import ops
    from splitserve.kvtransfer.client import KvTransferClient
    from splitserve.kvtransfer.config import KvTransferConfig
    from splitserve.kvtransfer.descriptor import PoolSpec, make_handle

    ctx = mp.get_context("spawn")
    port_q, stop_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_serve, args=(port_q, stop_q), daemon=True)
    proc.start()
    unpacks = []
    real_unpack = ops.unpack_kv_blocks
    ops.unpack_kv_blocks = lambda *a: unpacks.append(1) or real_unpack(*a)
    try:
        port = port_q.get(timeout=300)
        dst = torch.zeros(SHAPE, device="cuda")
        spec = PoolSpec.of(dst, "h")
        client = KvTransferClient(dst, spec, KvTransferConfig(checksum="always"))
        handle = make_handle(
            spec,
            host="127.0.0.1",
            port=port,
            lease_id=lease,
            request_id="r",
            num_blocks=N,
            num_tokens=N * SHAPE[3],
            ttl_s=30,
        )

        async def pull():
            try:
                return await client.pull(handle, dest)
            finally:
                client.close()

        stats = asyncio.run(pull())
        torch.cuda.synchronize()
        src = _source_pool()[:, :, RUN if lease == "run" else SCATTERED]
        assert stats.num_bytes == src.numel() * 4
        assert torch.equal(dst[:, :, dest].cpu(), src)
        assert len(unpacks) == (dest is SCATTERED)  # a run of blocks is received in place
    finally:
        ops.unpack_kv_blocks = real_unpack
        stop_q.put(None)
        proc.join(60)
