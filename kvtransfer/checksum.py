"""A cheap payload checksum computed where the data lives (GPU or CPU), and when to use it.

The payload is the lease's blocks as [L, 2, n, BS, heads, D] (a packed staging buffer, or a
contiguous run of blocks in the pool itself: any tensor whose n blocks are contiguous per layer
and K/V). Its words are summed per row of up to 1024 words in int64, and row sums are weighted
by their row index: truncation, zeroed or shifted rows and flipped bits change the value;
integer wrap-around makes it independent of reduction order, hence equal on CPU and GPU, and
it needs no copy (no padding, no contiguous payload).

When (`KvTransferConfig.checksum`): `between_hosts` (the default) verifies a pull whose peer is
on another host (UCX over TCP or RDMA: a NIC, cables, another machine's memory) and skips it on
one host (shared memory or cuda_ipc: a memory copy, and on the GPU the checksum would cost more
than 5 % of a 16 MiB transfer); `always` and `never` override.
"""

from __future__ import annotations

import functools
import ipaddress
import socket

import torch

_ROW = 1024


def payload_checksum_async(payload: torch.Tensor) -> torch.Tensor:
    """The checksum as a 0-d int64 tensor, queued on the current stream (no host sync)."""
    flat = payload.flatten(2) if payload.dim() > 2 else payload.reshape(1, 1, -1)
    raw = flat.view(torch.uint8)
    nbytes = raw.shape[-1]
    word = torch.int32 if nbytes % 4 == 0 else torch.int16 if nbytes % 2 == 0 else torch.uint8
    words = raw.view(word)
    n = words.shape[-1]
    row = _ROW
    while n % row:
        row //= 2
    sums = words.unflatten(-1, (n // row, row)).sum(dim=-1, dtype=torch.int64).reshape(-1)
    weights = torch.arange(1, sums.numel() + 1, device=sums.device, dtype=torch.int64)
    return (sums * weights).sum()


def readback(checksum: torch.Tensor) -> torch.Tensor:
    """A host copy queued on the current stream (pinned: no sync); read it after the stream's
    wait with `to_u64`."""
    if not checksum.is_cuda:
        return checksum
    host = torch.empty((), dtype=torch.int64, pin_memory=True)
    host.copy_(checksum, non_blocking=True)
    return host


def to_u64(checksum: torch.Tensor) -> int:
    return int(checksum.item()) & 0xFFFFFFFFFFFFFFFF


def wants_checksum(mode: str, peer_host: str) -> bool:
    if mode == "always":
        return True
    if mode == "never":
        return False
    return not is_local_host(peer_host)


@functools.lru_cache(maxsize=256)
def is_local_host(host: str) -> bool:
    """Whether `host` is this machine (loopback, or one of its own addresses by name)."""
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False  # unresolvable here: treat as remote (verify)
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        return True
    try:
        own = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        own = set()
    return bool(addrs) and addrs <= own
