"""Tensor-parallel state of one rank: no globals, a `TPGroup` passed to whoever needs it.

    rank 0 (serves gRPC, schedules)          rank r > 0 (follower)
    ───────────────────────────────          ─────────────────────
    device_group: all_reduce after o_proj / down, broadcast of the sampled tokens
                  (NCCL on CUDA: capturable in CUDA graphs; gloo on CPU: eager only)
    cpu_group:    gloo, the step commands rank 0 publishes (tp_control.py), signed with
                  `control_key` (tp_channel.py)

Each rank holds heads [rank*H/tp, (rank+1)*H/tp) of q and of KV and the same slice of the MLP
columns; norms are replicated. Embedding and lm_head are vocab-parallel (as vLLM's): rank r
holds rows [r*Vp, (r+1)*Vp) with Vp = ceil(V/tp) (the last rank's tail past V is zero padding);
the embedding is summed over ranks (all_reduce), the logits gathered (all_gather) so every rank
has the same full logits; rank 0's sampled tokens are broadcast so no rank can diverge.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

# The control group idles while no request comes in: its receives must not time out.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
# Joining the group (store connect, gloo/NCCL mesh set-up). Rank 0 also watches its followers'
# processes while they join (tp_control.start_ranks): this only bounds a follower that hangs.
JOIN_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None
    # authenticates rank 0's commands on cpu_group (tp_channel.py); fresh per launch
    control_key: bytes = field(default=b"", repr=False)

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

    def vocab_shard(self, vocab: int) -> tuple[int, int]:
        """(first row, rows per rank) of this rank's vocab slice: ceil(vocab/size) rows, so a vocab that
        does not divide is padded at the end (padded rows are zero; their logits are sliced off)."""
        part = -(-vocab // self.size)
        return self.rank * part, part

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[R, ...] on every rank -> [size*R, ...], rank r's rows at [r*R, (r+1)*R). One fixed-shape
        collective into a fresh tensor: capturable in a CUDA graph on NCCL."""
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=self.device_group)
        return out


# The same collective under its newer name (all_gather_into_tensor warns it is deprecated there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

SINGLE = TPGroup()


def rendezvous_store(size: int) -> tuple[dist.TCPStore, str]:
    """Rank 0's store, made before any follower exists (port 0: no race for a free port); the
    followers reach it at the returned `tcp://` address."""
    store = dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=JOIN_TIMEOUT
    )
    return store, f"tcp://127.0.0.1:{store.port}"


def joined_key(rank: int) -> str:
    """Set by a follower just before it joins the group: rank 0 joins once every follower has."""
    return f"splitserve/tp_joined/{rank}"


def init_tp(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    store: dist.Store | None = None,
    control_key: bytes = b"",
) -> TPGroup:
    """Joins the worker's process group (blocks until every rank has joined); rank 0 passes the
    store of `rendezvous_store`, followers connect to `init_method`. `control_key`: the launch's
    key of the control messages (tp_channel.py)."""
    if size == 1:
        return SINGLE
    if store is None:
        url = urlparse(init_method)
        store = dist.TCPStore(url.hostname, url.port, size, is_master=False, timeout=JOIN_TIMEOUT)
        store.set(joined_key(rank), "1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kwargs)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, size, device_group, cpu_group, control_key)


def check_devices(device: torch.device, size: int) -> None:
    """ValueError (one line naming the fields) when ranks cuda:i..cuda:i+size-1 are not all
    visible; checked before any rank is spawned."""
    if device.type != "cuda":
        return
    first = device.index or 0
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if first + size > count:
        raise ValueError(
            f"parallel.tensor_parallel_size {size} with engine.device {device} needs GPUs "
            f"cuda:{first}..cuda:{first + size - 1}, but {count} GPU(s) are visible; lower "
            "parallel.tensor_parallel_size, start engine.device at a lower index, or make more GPUs "
            "visible (CUDA_VISIBLE_DEVICES)"
        )


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
