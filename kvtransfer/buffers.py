"""Tensor <-> UCX buffer views, and a per-process transfer stream for pack/unpack.

UCX reads host memory through the buffer protocol and device memory through
`__cuda_array_interface__`; both are exposed on a uint8 view (bf16 has no numpy or CAI type).
Pack/unpack run on their own CUDA stream and are awaited through an event in a worker thread,
never with a device-wide synchronize, so the engine's stream keeps running.

Payload framing (both sides compute it from the geometry, the reply states it): the payload
[L, 2, n, BS, heads, D] goes as `num_messages` even pieces. Large payloads go as whole
(layer, K/V) slabs of n blocks, k pieces per slab (`plan_messages`): a side whose n blocks are
one contiguous run in its pool (and all of its heads) then sends from / receives into the pool
itself, with no pack or unpack (`slab_views`); otherwise it packs into / unpacks from staging.
"""

from __future__ import annotations

import asyncio
from contextlib import nullcontext

import torch

from splitserve.kvtransfer import frames

_POLLS = 200
# below this slab size a packed single message wins (fewer messages, one kernel each side)
ZERO_COPY_MIN_SLAB_BYTES = 2**20


class DeviceBytes:
    """`nbytes` of device memory as UCX reads it (CUDA's array interface, uint8), without a
    tensor per piece: torch's `__cuda_array_interface__` and the views that feed it
    cost several microseconds each, and a slab-framed pull has 32+ pieces on each side.
    `owner` (contiguous) keeps the memory alive; the bytes start `offset` bytes into it."""

    def __init__(self, owner: torch.Tensor, offset: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (owner.data_ptr() + offset, False),
            "strides": None,
            "version": 3,
        }
        self.owner, self.offset, self.nbytes = owner, offset, nbytes

    def tensor(self) -> torch.Tensor:
        """The same bytes as a uint8 tensor (fault injection edits them)."""
        flat = self.owner.reshape(-1).view(torch.uint8)
        return flat[self.offset : self.offset + self.nbytes]


def byte_views(t: torch.Tensor, ranges) -> list:
    """UCX buffers of the (byte offset, byte length) `ranges` of contiguous `t`."""
    if not t.is_contiguous():
        raise ValueError("byte views need a contiguous tensor")
    if t.is_cuda:
        return [DeviceBytes(t, off, size) for off, size in ranges]
    flat = t.reshape(-1).view(torch.uint8).numpy()
    return [flat[off : off + size] for off, size in ranges]


def ucx_view(t: torch.Tensor):
    if t.is_cuda and t.is_contiguous():
        return DeviceBytes(t, 0, t.numel() * t.element_size())
    flat = t.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


class TransferStream:
    def __init__(self, device: torch.device) -> None:
        # the highest priority: a piece's gather / landing gets SMs ahead of the kernels the
        # engine queued (a prefill's GEMMs would otherwise delay a streamed piece)
        self.stream = torch.cuda.Stream(device, priority=-100) if device.type == "cuda" else None

    def context(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    async def wait(self) -> None:
        """Waits, off the event loop, until the work queued on this stream has finished."""
        if self.stream is None:
            return
        event = torch.cuda.Event()
        event.record(self.stream)
        # Cooperative polling first: a pack or unpack takes well under a millisecond, and a
        # thread hop costs about as much; long waits go to a thread so the loop stays free.
        for _ in range(_POLLS):
            if event.query():
                return
            await asyncio.sleep(0)
        await asyncio.to_thread(event.synchronize)

    def after_engine(self) -> None:
        """Orders this stream after work already queued on the engine's current stream."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))


def ids_tensor(blocks: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on `device`, copied from pinned memory on the current stream (no sync)."""
    host = torch.tensor(blocks, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def contiguous_start(blocks: list[int]) -> int | None:
    """The first block when `blocks` are one ascending run (b, b+1, ...), else None."""
    if not blocks:
        return None
    b0 = blocks[0]
    return b0 if blocks == list(range(b0, b0 + len(blocks))) else None


def plan_messages(payload_bytes: int, num_layers: int, limit: int) -> int:
    """How many even pieces the sender splits a payload into: per-slab pieces (a multiple of
    2 * num_layers, each within one slab) when slabs are large, else ceil(bytes / limit)."""
    slabs = 2 * num_layers
    slab = payload_bytes // slabs
    if slab >= ZERO_COPY_MIN_SLAB_BYTES and payload_bytes % slabs == 0:
        k = -(-slab // limit)
        while slab % k:  # pieces must not straddle two slabs
            k += 1
        return slabs * k
    return max(1, -(-payload_bytes // limit))


def slab_framed(num_messages: int, payload_bytes: int, num_layers: int) -> bool:
    slabs = 2 * num_layers
    if num_messages % slabs or payload_bytes % slabs:
        return False
    k = num_messages // slabs
    return (payload_bytes // slabs) % k == 0


def slab_views(kv_cache: torch.Tensor, b0: int, n: int, num_messages: int) -> list:
    """The UCX buffers of each piece of a slab-framed payload, straight in the pool: blocks
    [b0, b0 + n) of every (layer, K/V), k pieces each."""
    layers, _, num_blocks = kv_cache.shape[:3]
    k = num_messages // (2 * layers)
    block = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    slab, step = n * block, n * block // k
    starts = [(i * num_blocks + b0) * block for i in range(2 * layers)]
    return byte_views(kv_cache, [(s + o, step) for s in starts for o in range(0, slab, step)])


def piece_views(payload: torch.Tensor, num_messages: int) -> list:
    """Even pieces of a contiguous payload (the receiver sizes its buffers the same way)."""
    nbytes = payload.numel() * payload.element_size()
    chunk = -(-nbytes // num_messages)
    return byte_views(payload, [(o, min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)])


class StagingCache:
    """Host staging buffers kept for reuse (a fresh CPU tensor of a large payload costs page
    faults on every pull); device staging comes from the caching allocator instead. At most
    `keep` buffers of each shape are kept; concurrent pulls beyond that allocate."""

    def __init__(self, device: torch.device, dtype: torch.dtype, keep: int = 2) -> None:
        self.device, self.dtype, self.keep = device, dtype, keep
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, shape: tuple) -> torch.Tensor:
        free = self.free.get(shape)
        if free:
            return free.pop()
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def give(self, t: torch.Tensor) -> None:
        if t.is_cuda:
            return
        free = self.free.setdefault(tuple(t.shape), [])
        if len(free) < self.keep:
            free.append(t)


async def receive_or_abort(ep, receive, timeout: float, *also_cancel, keep=()) -> None:
    """Awaits `receive` (UCX receives into a caller's buffers) for at most `timeout`; when it
    fails, times out or is cancelled, the endpoint is aborted first (ending its posted
    requests), `also_cancel` futures are cancelled and the receive's buffers (`keep`) are
    parked (frames.park): a receive still posted could otherwise write into staging freed by
    then, or into pool blocks another request owns."""
    try:
        await asyncio.wait_for(receive, timeout)
    except BaseException:
        ep.abort()  # (the endpoint pool's discard aborts again: a no-op)
        for fut in also_cancel:
            fut.cancel()
        frames.park(ep, *keep)
        raise
