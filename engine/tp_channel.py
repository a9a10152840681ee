"""Rank 0's commands to its tensor-parallel followers on the wire: framed, authenticated, in order.

One message is two broadcasts from rank 0 over the worker's gloo `cpu_group`: an int64 tensor
holding the frame's length, then the frame itself as a uint8 tensor. No pickle anywhere:

    header (16 bytes, little-endian)                     payload         tag (32 bytes)
    version u16 | kind u16 | seq u64 | payload_len u32 | payload_len B | HMAC-SHA256(key,
                                                                          header || payload)

`kind` and the payload's layout: tp_messages.py. `seq` numbers one launch's messages from 0; a
follower accepts only the next one, so a replayed, dropped or reordered message is refused. The
tag covers the whole header, so not even the kind or the sequence number can change without the
key.

The key is fresh per launch: HMAC-SHA256(cluster secret, label || 32 random bytes) when the
deployment has a cluster secret (service/credentials.py), else 32 random bytes; per launch, so a
message recorded from another launch or another worker of the same deployment never verifies.
Rank 0 makes it before it spawns the followers and hands it to them in their spawn arguments
(`FollowerLaunch`, sent down multiprocessing's spawn pipe, which only parent and child hold); it
is never logged. A follower refuses a frame that fails any check with ControlMessageError
(tp_follower.follow logs that one line and exits CONTROL_REFUSED_EXIT: a lost rank for rank 0).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from splitserve.engine.parallel import TPGroup
from splitserve.engine.tp_messages import ControlMessageError, decode_command

VERSION = 1
HEADER = struct.Struct("<HHQI")  # version, kind, seq, payload_len
TAG_BYTES = 32
MIN_FRAME_BYTES = HEADER.size + TAG_BYTES
# bounds what a forged length makes a follower allocate before the tag can be checked; a real
# frame is far smaller (the largest, write_slots, carries a batch's prompts as int64)
MAX_FRAME_BYTES = 1 << 30
KEY_LABEL = b"splitserve tensor-parallel control v1\x00"


@dataclass(frozen=True)
class FollowerLaunch:
    """A follower process's spawn argument: where to join the group and the key of rank 0's
    control messages (kept out of repr, so out of logs)."""

    init_method: str
    control_key: bytes = field(repr=False)


def new_control_key(secret: bytes | None) -> bytes:
    """One launch's key (module docstring): derived from the cluster secret when there is one."""
    nonce = secrets.token_bytes(32)
    if secret is None:
        return nonce
    return hmac.new(secret, KEY_LABEL + nonce, hashlib.sha256).digest()


def _tag(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def _checked_key(key: bytes) -> bytes:
    if len(key) < 32:
        raise ValueError(
            "a tensor-parallel control channel needs a 32-byte key; start the ranks through "
            "tp_control.start_ranks, which makes one per launch"
        )
    return key


class FrameSealer:
    """Rank 0: numbers and signs each payload."""

    def __init__(self, key: bytes) -> None:
        self._key = _checked_key(key)
        self.next_seq = 0

    def seal(self, kind: int, payload: bytes) -> bytes:
        body = HEADER.pack(VERSION, kind, self.next_seq, len(payload)) + payload
        self.next_seq += 1
        return body + _tag(self._key, body)


class FrameOpener:
    """A follower: checks each frame (tag first, then version, sequence number, kind, payload)
    and returns its command; ControlMessageError, one line, for the first check that fails."""

    def __init__(self, key: bytes) -> None:
        self._key = _checked_key(key)
        self.next_seq = 0

    def open(self, frame: bytes) -> tuple:
        if len(frame) < MIN_FRAME_BYTES:
            raise ControlMessageError(
                f"a frame of {len(frame)} bytes, shorter than header and tag ({MIN_FRAME_BYTES})"
            )
        body, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
        if not hmac.compare_digest(tag, _tag(self._key, body)):
            raise ControlMessageError(
                "bad HMAC tag: the message was altered, or not signed with this launch's key"
            )
        version, kind, seq, length = HEADER.unpack_from(body)
        if version != VERSION:
            raise ControlMessageError(f"format version {version}; this rank reads {VERSION}")
        if seq != self.next_seq:
            raise ControlMessageError(
                f"sequence number {seq} where {self.next_seq} was expected (a replayed, dropped "
                "or reordered message)"
            )
        if length != len(body) - HEADER.size:
            raise ControlMessageError(
                f"header says {length} payload bytes, the frame has {len(body) - HEADER.size}"
            )
        command = decode_command(kind, body[HEADER.size :])
        self.next_seq += 1
        return command


def check_frame_length(n: int) -> int:
    """The announced length of the next frame, refused before anything that big is allocated."""
    if not MIN_FRAME_BYTES <= n <= MAX_FRAME_BYTES:
        raise ControlMessageError(
            f"announced frame length {n} outside [{MIN_FRAME_BYTES}, {MAX_FRAME_BYTES}]"
        )
    return n


def broadcast_frame(tp: TPGroup, frame: bytes) -> None:
    """Rank 0: the frame's length, then the frame, to every rank of `tp.cpu_group`."""
    dist.broadcast(torch.tensor([len(frame)], dtype=torch.int64), src=0, group=tp.cpu_group)
    data = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=tp.cpu_group)


def receive_frame(tp: TPGroup) -> bytes:
    """A follower: the next frame rank 0 broadcasts (its length checked first)."""
    n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, src=0, group=tp.cpu_group)
    data = torch.empty(check_frame_length(int(n)), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=tp.cpu_group)
    return data.numpy().tobytes()


class ControlSender:
    """Rank 0's end: `send(kind, payload)` from one thread, in order."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp, self.sealer = tp, FrameSealer(tp.control_key)

    def send(self, kind: int, payload: bytes) -> None:
        broadcast_frame(self.tp, self.sealer.seal(kind, payload))


class ControlReceiver:
    """A follower's end: `receive()` is rank 0's next command, checked (ControlMessageError)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp, self.opener = tp, FrameOpener(tp.control_key)

    def receive(self) -> tuple:
        return self.opener.open(receive_frame(self.tp))
