"""The commands rank 0 sends its tensor-parallel followers, as typed binary payloads (no pickle).

A command is a tuple `(name, *fields)`: the call a follower replays (tp_follower.py). Each name
has a kind number and a fixed field layout. Integers are little-endian int64 (a sampling seed:
uint64); a list is a uint32 count, then its items; text is a uint32 byte count, then UTF-8; a
choice is a uint8 tag, then the chosen part. Nothing else can be expressed, so decoding builds
only these values and the dataclasses named below.

    kind  name         fields
    1     stop         -
    2     zero_kv      -
    3     prefill      chunks: list of (token_ids: ints, num_computed: int, block_table: ints)
    4     decode       lanes: list of (token_id: int, position: int, block_table: ints)
    5     lease_grant  lease_id: text, request_id: text, block_ids: ints
    6     lease_drop   lease_ids: list of text
    7     capture      sizes: ints, warmup_steps: int
    8     graph_step   n: int, graph_size: int,
                       prep: tag 0 none | 1 prepare (size: int, tables: list of ints,
                       positions, host_ids, src_rows, slots: ints) | 2 patch (cells: list of
                       (row, column, block: int)),
                       variant: int
    9     write_slots  slots: ints, rows: list of (params: text, the SamplingParams as JSON,
                       validated by its model; prompt_token_ids, output_token_ids: ints,
                       seed: uint64, step: int)
    10    kv_in        dest_blocks: ints, parts: list of (rank, head_start, head_end: int,
                       shape: ints)
    11-13 stream_*     the streamed hand-over's (tp_stream_messages.py)

A payload that does not parse exactly (too short, bytes left over, bad UTF-8, parameters their
model refuses) raises ControlMessageError. The frame around a payload (version, sequence number,
HMAC tag) and its transport: tp_channel.py.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

from splitserve.engine.model_runner import DecodeLane, PrefillChunk
from splitserve.engine.sampling_state import RowInit
from splitserve.engine.tp_stream_messages import STREAM_CODECS
from splitserve.request.sampling_params import SamplingParams

_I64, _U64, _U32, _U8 = (struct.Struct(f"<{c}") for c in "qQIB")
_PREP_NONE, _PREP_PREPARE, _PREP_PATCH = 0, 1, 2


class ControlMessageError(Exception):
    """A control message a follower refuses; the text is one line saying why."""


class _Writer:
    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def i64(self, v: int) -> None:
        self.parts.append(_I64.pack(v))

    def u64(self, v: int) -> None:
        self.parts.append(_U64.pack(v))

    def u8(self, v: int) -> None:
        self.parts.append(_U8.pack(v))

    def count(self, n: int) -> None:
        self.parts.append(_U32.pack(n))

    def ints(self, values: Sequence[int]) -> None:
        self.parts.append(struct.pack(f"<I{len(values)}q", len(values), *values))

    def text(self, s: str) -> None:
        data = s.encode()
        self.count(len(data))
        self.parts.append(data)


class _Reader:
    __slots__ = ("data", "off")

    def __init__(self, data: bytes) -> None:
        self.data, self.off = data, 0

    def _take(self, n: int) -> int:
        """The offset of the next `n` bytes, which must be there."""
        start = self.off
        if n > len(self.data) - start:
            raise ValueError(f"it ends after {len(self.data)} bytes, {n} more were needed")
        self.off = start + n
        return start

    def _one(self, st: struct.Struct) -> int:
        return st.unpack_from(self.data, self._take(st.size))[0]

    def i64(self) -> int:
        return self._one(_I64)

    def u64(self) -> int:
        return self._one(_U64)

    def u8(self) -> int:
        return self._one(_U8)

    def count(self) -> int:
        return self._one(_U32)

    def ints(self) -> list[int]:
        n = self.count()
        return list(struct.unpack_from(f"<{n}q", self.data, self._take(8 * n)))

    def text(self) -> str:
        n = self.count()
        start = self._take(n)
        return self.data[start : start + n].decode()

    def items(self, read_one: Callable[[], object]) -> list:
        n = self.count()
        if n > len(self.data) - self.off:  # every item takes at least one byte
            raise ValueError(f"a count of {n} items in {len(self.data) - self.off} bytes")
        return [read_one() for _ in range(n)]

    def end(self) -> None:
        if self.off != len(self.data):
            raise ValueError(f"{len(self.data) - self.off} bytes are left over")


# ---- one encoder and one decoder per command ------------------------------------------------
def _enc_nothing(w: _Writer) -> None:
    pass


def _dec_nothing(r: _Reader) -> tuple:
    return ()


def _enc_prefill(w: _Writer, chunks: Sequence[PrefillChunk]) -> None:
    w.count(len(chunks))
    for c in chunks:
        w.ints(c.token_ids)
        w.i64(c.num_computed)
        w.ints(c.block_table)


def _dec_prefill(r: _Reader) -> tuple:
    return (r.items(lambda: PrefillChunk(r.ints(), r.i64(), tuple(r.ints()))),)


def _enc_decode(w: _Writer, lanes: Sequence[DecodeLane]) -> None:
    w.count(len(lanes))
    for lane in lanes:
        w.i64(lane.token_id)
        w.i64(lane.position)
        w.ints(lane.block_table)


def _dec_decode(r: _Reader) -> tuple:
    return (r.items(lambda: DecodeLane(r.i64(), r.i64(), tuple(r.ints()))),)


def _enc_lease_grant(w: _Writer, lease_id: str, request_id: str, blocks: Sequence[int]) -> None:
    w.text(lease_id)
    w.text(request_id)
    w.ints(blocks)


def _dec_lease_grant(r: _Reader) -> tuple:
    return r.text(), r.text(), tuple(r.ints())


def _enc_lease_drop(w: _Writer, lease_ids: Sequence[str]) -> None:
    w.count(len(lease_ids))
    for lid in lease_ids:
        w.text(lid)


def _dec_lease_drop(r: _Reader) -> tuple:
    return (r.items(r.text),)


def _enc_capture(w: _Writer, sizes: Sequence[int], warmup_steps: int) -> None:
    w.ints(sizes)
    w.i64(warmup_steps)


def _dec_capture(r: _Reader) -> tuple:
    return r.ints(), r.i64()


def _enc_graph_step(w: _Writer, n: int, graph_size: int, prep: tuple | None, variant: int) -> None:
    w.i64(n)
    w.i64(graph_size)
    if prep is None:
        w.u8(_PREP_NONE)
    elif prep[0] == "prepare":
        _, size, tables, positions, host_ids, src_rows, slots = prep
        w.u8(_PREP_PREPARE)
        w.i64(size)
        w.count(len(tables))
        for t in tables:
            w.ints(t)
        for values in (positions, host_ids, src_rows, slots):
            w.ints(values)
    elif prep[0] == "patch":
        w.u8(_PREP_PATCH)
        w.count(len(prep[1]))
        for row, col, block in prep[1]:
            w.i64(row)
            w.i64(col)
            w.i64(block)
    else:
        raise ValueError(f"graph_step has no prep {prep[0]!r}")
    w.i64(variant)


def _dec_graph_step(r: _Reader) -> tuple:
    n, graph_size, tag = r.i64(), r.i64(), r.u8()
    if tag == _PREP_NONE:
        prep = None
    elif tag == _PREP_PREPARE:
        size, tables = r.i64(), r.items(r.ints)
        prep = ("prepare", size, tables, r.ints(), r.ints(), r.ints(), r.ints())
    elif tag == _PREP_PATCH:
        prep = ("patch", r.items(lambda: (r.i64(), r.i64(), r.i64())))
    else:
        raise ValueError(f"no graph_step prep tag {tag}")
    return n, graph_size, prep, r.i64()


def _enc_write_slots(w: _Writer, slots: Sequence[int], rows: Sequence[RowInit]) -> None:
    w.ints(slots)
    w.count(len(rows))
    for row in rows:
        w.text(row.params.model_dump_json())
        w.ints(row.prompt_token_ids)
        w.ints(row.output_token_ids)
        w.u64(row.seed)
        w.i64(row.step)


def _dec_write_slots(r: _Reader) -> tuple:
    def row() -> RowInit:
        params = SamplingParams.model_validate_json(r.text())
        return RowInit(params, r.ints(), r.ints(), r.u64(), r.i64())

    return r.ints(), r.items(row)


def _enc_kv_in(w: _Writer, dest_blocks: Sequence[int], parts: Sequence[tuple]) -> None:
    w.ints(dest_blocks)
    w.count(len(parts))
    for rank, start, end, shape in parts:
        w.i64(rank)
        w.i64(start)
        w.i64(end)
        w.ints(shape)


def _dec_kv_in(r: _Reader) -> tuple:
    return r.ints(), r.items(lambda: (r.i64(), r.i64(), r.i64(), tuple(r.ints())))


_CODECS: dict[str, tuple[int, Callable[..., None], Callable[[_Reader], tuple]]] = {
    "stop": (1, _enc_nothing, _dec_nothing),
    "zero_kv": (2, _enc_nothing, _dec_nothing),
    "prefill": (3, _enc_prefill, _dec_prefill),
    "decode": (4, _enc_decode, _dec_decode),
    "lease_grant": (5, _enc_lease_grant, _dec_lease_grant),
    "lease_drop": (6, _enc_lease_drop, _dec_lease_drop),
    "capture": (7, _enc_capture, _dec_capture),
    "graph_step": (8, _enc_graph_step, _dec_graph_step),
    "write_slots": (9, _enc_write_slots, _dec_write_slots),
    "kv_in": (10, _enc_kv_in, _dec_kv_in),
    **STREAM_CODECS,
}
KIND: dict[str, int] = {name: kind for name, (kind, _, _) in _CODECS.items()}
_BY_KIND = {kind: (name, dec) for name, (kind, _, dec) in _CODECS.items()}


def encode_command(cmd: tuple) -> tuple[int, bytes]:
    """(kind, payload) of `cmd`; ValueError for a command or a value the format cannot carry
    (a bug on rank 0, raised on the caller's thread)."""
    name, *fields = cmd
    if name not in _CODECS:
        raise ValueError(f"no tensor-parallel control command {name!r}")
    kind, enc, _ = _CODECS[name]
    w = _Writer()
    try:
        enc(w, *fields)
    except struct.error as exc:
        raise ValueError(f"cannot encode tensor-parallel command {name!r}: {exc}") from None
    return kind, b"".join(w.parts)


def decode_command(kind: int, payload: bytes) -> tuple:
    """The command `(name, *fields)` of an authenticated payload; ControlMessageError when the
    kind is unknown or the payload does not parse exactly."""
    if kind not in _BY_KIND:
        raise ControlMessageError(f"unknown message kind {kind}")
    name, dec = _BY_KIND[kind]
    r = _Reader(payload)
    try:
        fields = dec(r)
        r.end()
    except (ValueError, struct.error) as exc:  # pydantic's ValidationError and bad UTF-8 too
        reason = " ".join(str(exc).split())[:300]  # one line, bounded
        raise ControlMessageError(f"malformed {name} payload: {reason}") from None
    return (name, *fields)
