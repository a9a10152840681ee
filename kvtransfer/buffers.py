"""Tensor <-> UCX buffer views, and a per-process transfer stream for pack/unpack.

UCX reads host memory through the buffer protocol and device memory through
`__cuda_array_interface__`; both are exposed on a uint8 view (bf16 has no numpy or CAI type).
Pack/unpack run on their own CUDA stream and are awaited through an event in a worker thread,
never with a device-wide synchronize, so the engine's stream keeps running.
"""

from __future__ import annotations

import asyncio
from contextlib import nullcontext

import torch

_POLLS = 200


def ucx_view(t: torch.Tensor):
    flat = t.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


class TransferStream:
    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

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
