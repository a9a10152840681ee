"""Tensor-parallel state of one rank: no globals, a `TPGroup` passed to whoever needs it.

    rank 0 (serves gRPC, schedules)          rank r > 0 (follower)
    ───────────────────────────────          ─────────────────────
    device_group: all_reduce after o_proj / down, broadcast of the sampled tokens
                  (NCCL on CUDA: capturable in CUDA graphs; gloo on CPU: eager only)
    cpu_group:    gloo, the step commands rank 0 publishes (tp_control.py)

Each rank holds heads [rank*H/tp, (rank+1)*H/tp) of q and of KV and the same slice of the MLP
columns; embedding, norms and lm_head are replicated (every rank computes the same logits,
rank 0's sampled tokens are broadcast so no rank can diverge).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# The control group idles while no request comes in: its receives must not time out.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def shard(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's slice of `total` (heads, columns); total % size == 0."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (identity at size 1)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def broadcast_(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank gets rank `src`'s `x` (contiguous), in place."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.device_group)
        return x


SINGLE = TPGroup()


def init_tp(rank: int, size: int, init_method: str, device: torch.device) -> TPGroup:
    """Joins the worker's process group (blocks until every rank has joined)."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, **kwargs)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, size, device_group, cpu_group)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a worker started on cuda:i runs on cuda:i+r; CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def destroy_tp(tp: TPGroup) -> None:
    if tp.size > 1 and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone: nothing left to tear down cleanly
            pass
