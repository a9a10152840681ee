"""Control frames of a KV pull: one UCX message each (no size message first, as send_obj has).

A frame is a 4-byte little-endian length and a serialized protobuf, received into a fixed
FRAME_BYTES buffer (UCX accepts a message shorter than the posted buffer). Control frames use
the endpoint's default tag, payload messages PAYLOAD_TAG, so a frame and the payload never
match each other's receives whatever order they arrive in.
"""

from __future__ import annotations

import struct
import time
from collections import deque

import numpy as np

FRAME_BYTES = 16384  # a request id of 1024 characters (UTF-8) and a capped message fit
PAYLOAD_TAG = 0x4B5650  # an int: ucxx hashes a tag with hash(), which is per-process for str
_LEN = struct.Struct("<I")
_MESSAGE_ROOM = 2048  # a reply's human-readable message is cut to fit the frame
PARK_S = 300.0  # how long an abandoned transfer's buffers are kept alive

# Buffers of sends and receives abandoned mid-flight (timed out, cancelled, failed): UCX holds
# raw pointers to them until the request is cancelled by the endpoint's abort and that
# cancellation is processed, and a message arriving late may still land. Freed at once, their
# memory could be reused by Python or the allocator and then written by UCX (a decode
# worker crashed with SIGSEGV in a test whose link came back after a failed stream).
_PARKED: deque[tuple[float, tuple]] = deque()


def park(*buffers) -> None:
    """Keeps `buffers` alive for PARK_S seconds (see _PARKED)."""
    now = time.monotonic()
    while _PARKED and now - _PARKED[0][0] > PARK_S:
        _PARKED.popleft()
    _PARKED.append((now, buffers))


def encode(msg) -> np.ndarray:
    if hasattr(msg, "message") and len(msg.message) > _MESSAGE_ROOM:
        msg.message = msg.message[:_MESSAGE_ROOM] + "..."
    body = msg.SerializeToString()
    if len(body) + _LEN.size > FRAME_BYTES:
        raise ValueError(f"{type(msg).__name__} of {len(body)} bytes exceeds a KV control frame")
    return np.frombuffer(_LEN.pack(len(body)) + body, dtype=np.uint8).copy()


def new_buffer() -> np.ndarray:
    return np.empty(FRAME_BYTES, dtype=np.uint8)


def decode(buf: np.ndarray, cls):
    """The message in a received frame; ValueError when the frame is malformed."""
    (n,) = _LEN.unpack_from(buf, 0)
    if n > FRAME_BYTES - _LEN.size:
        raise ValueError(f"KV control frame announces {n} bytes (at most {FRAME_BYTES})")
    return cls.FromString(buf[_LEN.size : _LEN.size + n].tobytes())


async def send(ep, msg) -> None:
    frame = encode(msg)
    try:
        await ep.send(frame)
    except BaseException:
        park(frame)
        raise


async def recv(ep, cls, buf: np.ndarray | None = None):
    buf = new_buffer() if buf is None else buf
    try:
        await ep.recv(buf)
    except BaseException:
        park(buf)  # (a caller's reused buffer too: it must not be reused for another receive)
        raise
    return decode(buf, cls)
