"""Random protobuf messages for the fuzz tests (test_fuzz_*.py), built from the protos'
descriptors: scalars at their edges, odd and huge text, nested messages, lists and maps; valid
messages with fields cleared or changed; bytes on the wire that are cut short, flipped or not
UTF-8; and a mix of all of these."""

from __future__ import annotations

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message
from hypothesis import strategies as st


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = {lo, hi, 0, 1, hi - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1}
    return st.sampled_from(sorted(e for e in edges if lo <= e <= hi)) | st.integers(lo, hi)


HUGE_SIZES = st.sampled_from([255, 256, 257, 1023, 1024, 1025, 4096, 70_000, 2**20 + 3])
ODD_CHARS = "\x00\x01\x7f\u200b\u202e\ufeff\U0001f600é#:/[]% \t\n\\\"'"
TEXT = (
    st.text(max_size=24)
    | st.text(st.sampled_from(ODD_CHARS), min_size=1, max_size=12)
    | st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "\x00", "😀", "#"]), HUGE_SIZES)
)
BYTES = st.binary(max_size=40) | st.builds(lambda n: b"\xff" * n, HUGE_SIZES)
SCALARS = {
    FD.TYPE_INT32: _ints(-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: _ints(-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: _ints(-(2**31), 2**31 - 1),
    FD.TYPE_INT64: _ints(-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: _ints(-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: _ints(-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: _ints(0, 2**32 - 1),
    FD.TYPE_FIXED32: _ints(0, 2**32 - 1),
    FD.TYPE_UINT64: _ints(0, 2**64 - 1),
    FD.TYPE_FIXED64: _ints(0, 2**64 - 1),
    FD.TYPE_FLOAT: st.floats(width=32),
    FD.TYPE_DOUBLE: st.floats(),
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_STRING: TEXT,
    FD.TYPE_BYTES: BYTES,
}


def _enum(field) -> st.SearchStrategy[int]:
    known = [v.number for v in field.enum_type.values]
    return st.sampled_from(known) | _ints(-(2**31), 2**31 - 1)  # open enums keep unknown numbers


def _single(field, depth: int) -> st.SearchStrategy:
    if field.type == FD.TYPE_MESSAGE:
        return random_message(message_factory.GetMessageClass(field.message_type), depth - 1)
    if field.type == FD.TYPE_ENUM:
        return _enum(field)
    return SCALARS[field.type]


def _is_map(field) -> bool:
    return field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def field_value(field, depth: int = 2) -> st.SearchStrategy:
    """A random value for `field`: a scalar, a message, a list (repeated) or a dict (map)."""
    if _is_map(field):
        key, value = (field.message_type.fields_by_name[n] for n in ("key", "value"))
        return st.dictionaries(_single(key, depth), _single(value, depth), max_size=4)
    if field.is_repeated:
        return st.lists(_single(field, depth), max_size=4)
    return _single(field, depth)


def assign(msg: Message, field, value) -> None:
    msg.ClearField(field.name)
    target = getattr(msg, field.name) if field.is_repeated else None
    if _is_map(field):
        if field.message_type.fields_by_name["value"].type == FD.TYPE_MESSAGE:
            for k, v in value.items():
                target[k].CopyFrom(v)
        else:
            target.update(value)
    elif target is not None:
        target.extend(value)
    elif field.type == FD.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


@st.composite
def _random_message(draw, cls: type[Message], depth: int) -> Message:
    msg = cls()
    if depth <= 0:
        return msg
    for field in cls.DESCRIPTOR.fields:
        if draw(st.booleans()):
            assign(msg, field, draw(field_value(field, depth)))
    return msg


def random_message(cls: type[Message], depth: int = 2) -> st.SearchStrategy[Message]:
    return _random_message(cls, depth)


@st.composite
def mutated(draw, valid: st.SearchStrategy[Message], skip: tuple[str, ...] = ()) -> Message:
    """A valid message with one to three fields (nested ones too) cleared or given a random
    value; fields named in `skip` are left alone."""
    msg = type(drawn := draw(valid))()
    msg.CopyFrom(drawn)  # never the strategy's own object (st.just would hand out the same one)
    for _ in range(draw(st.integers(1, 3))):
        target = msg
        fields = [f for f in target.DESCRIPTOR.fields if f.name not in skip]
        if not fields:  # an empty message: nothing to mutate
            return msg
        field = draw(st.sampled_from(fields))
        while (
            field.type == FD.TYPE_MESSAGE
            and not field.is_repeated
            and target.HasField(field.name)
            and draw(st.booleans())
        ):  # into a set sub-message
            target = getattr(target, field.name)
            fields = [f for f in target.DESCRIPTOR.fields if f.name not in skip]
            if not fields:
                break
            field = draw(st.sampled_from(fields))
        if draw(st.integers(0, 3)) == 0:
            target.ClearField(field.name)
        else:
            assign(target, field, draw(field_value(field, depth=2)))
    return msg


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@st.composite
def wire_bytes(draw, cls: type[Message], valid: st.SearchStrategy[Message]) -> bytes:
    """Bytes on the wire: random ones, a valid message cut short or with a flipped byte, or a
    valid message with a string field whose bytes are not UTF-8 (proto3 refuses them)."""
    kind = draw(st.sampled_from(["random", "cut", "flip", "utf8"]))
    if kind == "random":
        return draw(st.binary(max_size=160))
    raw = draw(valid).SerializeToString()
    # positions are drawn independently of the length (fresh ids make it vary between replays)
    if kind == "cut" and raw:
        return raw[: draw(st.integers(0, 2**16)) % len(raw)]
    if kind == "flip" and raw:
        i = draw(st.integers(0, 2**16)) % len(raw)
        return raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1 :]
    strings = [f for f in cls.DESCRIPTOR.fields if f.type == FD.TYPE_STRING]
    if not strings:
        return raw + draw(st.binary(min_size=1, max_size=8))
    field = draw(st.sampled_from(strings))
    bad = draw(
        st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"a\x80b", b"\xf8\x88\x80\x80\x80"])
    )
    return raw + _varint(field.number << 3 | 2) + _varint(len(bad)) + bad


def mix(cls: type[Message], valid: st.SearchStrategy[Message]) -> st.SearchStrategy:
    """Valid and mutated-valid messages (a mutation is mostly a refusal), random messages, and
    bytes on the wire, so that every kind of outcome comes up."""
    return st.one_of(
        valid, valid, mutated(valid), mutated(valid), random_message(cls), wire_bytes(cls, valid)
    )
