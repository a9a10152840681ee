"""Tensor-parallel decode worker: the follower ranks, and rank 0's spreading of pulled KV.

    rank 0 (DecodeWorker: gRPC, scheduler, sampler,          rank r (this module's process)
            block allocator, the only UCX client)
    ────────────────────────────────────────────────          ──────────────────────────────
    graphs.capture(sizes)   ── ("capture", sizes, n) ───────▶ same sizes, same order
    graphs.launch(...)      ── ("graph_step", n, size, prep) ▶ run_step: same padding, same graph
    graphs.write_slots      ── ("write_slots", slots, rows) ─▶ same sampling-state slots
    runner.prefill (recompute / colocated) ── ("prefill") ───▶ same chunks
    KV pulled from every prefill shard (any TP size) into staging on rank 0, then on the
    engine thread (between steps):  own heads -> own pool;
                            ── ("kv_in", blocks, parts) ────▶ recv its heads (device group)

Inside each step the sampled tokens are broadcast from rank 0, so every rank feeds rank 0's
choice to the next step. Rank 0 allocates every block; ids mean the same on every rank.
"""

from __future__ import annotations

import asyncio
import logging

import torch
import torch.distributed as dist

from splitserve.engine.tp_follower import follower_process
from splitserve.kernels import ops
from splitserve.kvtransfer.shards import head_overlap
from splitserve.worker.gc_pauses import then_freeze

log = logging.getLogger("splitserve.decode_worker.tp")


def write_heads(
    kv_cache: torch.Tensor, ids: torch.Tensor, piece: torch.Tensor, start: int, end: int
) -> None:
    """piece [L, 2, n, BS, end-start, D] into heads [start, end) of blocks `ids` of this pool."""
    if (start, end) == (0, kv_cache.shape[4]):
        ops.unpack_kv_blocks(piece.contiguous(), kv_cache, ids)
    else:
        kv_cache[:, :, :, :, start:end].index_copy_(2, ids, piece)


class TPKvInstaller:
    """Rank 0's `install` for the KV-transfer client: a verified shard (heads [s0, s1) of the
    model) is split by rank; runs on the engine thread so it is ordered with the steps."""

    def __init__(self, loop, runner) -> None:
        self.loop, self.runner = loop, runner

    async def __call__(
        self, staging: torch.Tensor, dest_blocks: list[int], s0: int, s1: int
    ) -> None:
        await asyncio.wrap_future(
            self.loop.call(lambda: self._install(staging, dest_blocks, s0, s1))
        )

    @torch.inference_mode()
    def _install(self, staging: torch.Tensor, dest_blocks: list[int], s0: int, s1: int) -> None:
        runner, tp = self.runner, self.runner.tp
        total = runner.model_config.num_key_value_heads
        ids = torch.tensor(dest_blocks, dtype=torch.int64).to(runner.device)
        parts = []
        for r in range(tp.size):
            r0, r1 = r * total // tp.size, (r + 1) * total // tp.size
            ov = head_overlap((s0, s1), (r0, r1))
            if ov is None:
                continue
            piece = staging[:, :, :, :, ov[0] - s0 : ov[1] - s0]
            if r == tp.rank:
                write_heads(runner.kv_cache, ids, piece, ov[0] - r0, ov[1] - r0)
            else:
                parts.append((r, ov[0] - r0, ov[1] - r0, piece.contiguous()))
        if parts:
            runner.mirror(
                ("kv_in", list(dest_blocks), [(r, a, b, tuple(p.shape)) for r, a, b, p in parts])
            )
            for r, _a, _b, p in parts:
                dist.send(p, dst=r, group=tp.device_group)


@follower_process
def decode_follower_main(rank: int, size: int, launch, cfg) -> None:
    """Entry of follower rank `rank` of a decode worker (`launch`: tp_channel.FollowerLaunch,
    `cfg`: its DecodeWorkerConfig)."""
    from splitserve.decode_worker.graph_runner import GraphRunner
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.parallel import destroy_tp
    from splitserve.engine.tp_follower import follow, join_as_follower

    tp = join_as_follower(rank, size, launch, cfg.engine)
    graphs = None
    try:
        runner = ModelRunner(cfg.engine, tp)
        graphs = GraphRunner(runner, cfg.engine.scheduler.max_batch_size)

        def graph_step(n: int, graph_size: int, prep, variant: int) -> None:
            slot = graphs.bufs.ring.acquire()
            graphs.run_step(slot, n, graph_size, prep, variant)
            slot.record()

        @torch.inference_mode()
        def kv_in(dest_blocks, parts) -> None:
            ids = torch.tensor(dest_blocks, dtype=torch.int64).to(runner.device)
            for r, a, b, shape in parts:
                if r == tp.rank:
                    buf = torch.empty(shape, dtype=runner.kv_cache.dtype, device=runner.device)
                    dist.recv(buf, src=0, group=tp.device_group)
                    write_heads(runner.kv_cache, ids, buf, a, b)

        follow(
            tp,
            runner,
            {
                "graph_step": graph_step,
                "write_slots": graphs.write_slots,
                "kv_in": kv_in,
                "capture": graphs.capture,
                "zero_kv": then_freeze(runner.zero_kv),  # warm-up's end (worker/gc_pauses.py)
            },
        )
    finally:
        if graphs is not None:
            graphs.release()
        destroy_tp(tp)
