"""The decode side's receive staging and the engine's CUDA stream (GPU).

UCX writes the staging outside any CUDA stream. If the staging were allocated from the engine's
stream pool, it could be memory that the allocator has just handed back while a kernel queued on
that stream still writes it: the kernel would then overwrite the payload after UCX delivered
it. Here the current stream holds exactly such a kernel (a long sleep, then a fill of a tensor of
the staging's size, freed at once); the pull must still deliver the prefill worker's bytes.
Before the fix (kvtransfer/client.py: the staging comes from the transfer stream's pool) this
pull failed its checksum.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPE = (4, 2, 33, 16, 2, 64)  # layers, K/V, blocks, block size, heads, head dim (fp32)
BLOCKS = list(range(1, 33))  # 32 blocks: 2 MiB of payload


def _source_pool() -> torch.Tensor:
    """The same pool in both processes (a seeded CPU generator)."""
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(1234))


class _OneLease:
    def begin_pull(self, lease_id, request_id):
        return list(BLOCKS)

    def end_pull(self, lease_id, delivered):
        pass


def _serve(port_q, stop_q) -> None:
    from splitserve.kvtransfer.config import KvTransferConfig
    from splitserve.kvtransfer.descriptor import PoolSpec
    from splitserve.kvtransfer.server import KvTransferServer

    async def main() -> None:
        pool = _source_pool().cuda()
        server = KvTransferServer(pool, PoolSpec.of(pool, "h"), _OneLease(), KvTransferConfig())
        port_q.put(await server.start())
        await asyncio.to_thread(stop_q.get)
        await server.close()

    asyncio.run(main())


def test_the_staging_is_not_memory_a_queued_kernel_still_writes():
    from splitserve.kvtransfer.client import KvTransferClient
    from splitserve.kvtransfer.config import KvTransferConfig
    from splitserve.kvtransfer.descriptor import PoolSpec, make_handle

    ctx = mp.get_context("spawn")
    port_q, stop_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_serve, args=(port_q, stop_q), daemon=True)
    proc.start()
    try:
        port = port_q.get(timeout=300)
        dst = torch.zeros(SHAPE, device="cuda")
        spec = PoolSpec.of(dst, "h")
        client = KvTransferClient(dst, spec, KvTransferConfig())
        handle = make_handle(
            spec,
            host="127.0.0.1",
            port=port,
            lease_id="L",
            request_id="r",
            num_blocks=len(BLOCKS),
            num_tokens=len(BLOCKS) * SHAPE[3],
            ttl_s=30,
        )
        dest = list(BLOCKS)
        staging_shape = (SHAPE[0], 2, len(BLOCKS), *SHAPE[3:])

        async def pull():
            await client.pull(handle, dest)  # connect first: a cold pull outlasts the kernel
            dst.zero_()
            torch.cuda.synchronize()
            # a stream of the engine's own, current in this thread (on the legacy default stream
            # the race hides: measured, UCX's copies then wait for the queued kernel)
            torch.cuda.set_stream(torch.cuda.Stream())
            freed = torch.empty(staging_shape, device="cuda")  # the block a staging could get
            torch.cuda._sleep(300_000_000)  # the engine's stream still busy (~0.15 s) ...
            freed.fill_(float("nan"))  # ... then writing memory the allocator already took back
            del freed
            try:
                return await client.pull(handle, dest)
            finally:
                client.close()

        stats = asyncio.run(pull())
        torch.cuda.synchronize()
        assert stats.num_bytes == dst[:, :, dest].numel() * dst.element_size()
        assert torch.equal(dst[:, :, dest].cpu(), _source_pool()[:, :, BLOCKS])
    finally:
        stop_q.put(None)
        proc.join(60)
