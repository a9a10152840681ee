"""Rank 0's control messages to its TP followers (engine/tp_messages.py, engine/tp_channel.py):
every command kind survives encode -> seal -> open unchanged (hypothesis over the field values);
a flipped bit anywhere, a replayed message, a message signed with another key, an unknown kind
and a malformed payload are each refused with a one-line ControlMessageError; no pickle is used
anywhere on the way (the modules' code is inspected, and the round trip runs with pickle
disabled). The follower's side of a refusal in real processes: test_tp_control_refusal.py."""

from __future__ import annotations

import ast
import hashlib
import hmac
import importlib
import inspect
import pickle
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.engine.model_runner import DecodeLane, PrefillChunk
from splitserve.engine.parallel import TPGroup
from splitserve.engine.sampling_state import RowInit
from splitserve.engine.tp_channel import (
    HEADER,
    MAX_FRAME_BYTES,
    MIN_FRAME_BYTES,
    VERSION,
    FollowerLaunch,
    FrameOpener,
    FrameSealer,
    check_frame_length,
    new_control_key,
)
from splitserve.engine.tp_messages import KIND, ControlMessageError, decode_command, encode_command
from splitserve.request.sampling_params import SamplingParams

I64 = st.integers(-(2**63), 2**63 - 1)
INTS = st.lists(I64, max_size=6)
NAT = st.integers(0, 2**31)
FLOAT = dict(allow_nan=False, allow_infinity=False)

PARAMS = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 2**32),
    temperature=st.floats(0.0, 10.0, **FLOAT),
    top_p=st.floats(1e-6, 1.0, **FLOAT),
    top_k=st.integers(-1, 2**32 - 1),
    min_p=st.floats(0.0, 1.0, **FLOAT),
    seed=st.none() | st.integers(0, 2**64 - 1),
    repetition_penalty=st.floats(1e-3, 10.0, **FLOAT),
    presence_penalty=st.floats(-2.0, 2.0, **FLOAT),
    frequency_penalty=st.floats(-2.0, 2.0, **FLOAT),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=3).map(tuple),
    stop_token_ids=st.lists(NAT, max_size=4).map(tuple),
    include_stop_str_in_output=st.booleans(),
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20),
    min_tokens=st.integers(0, 1),
    logit_bias=st.dictionaries(NAT, st.floats(-100.0, 100.0, **FLOAT), max_size=4),
)
ROW = st.builds(
    RowInit, PARAMS, INTS, INTS, st.integers(0, 2**64 - 1), I64
)  # what SamplingSlots.assign sends
PREP = st.one_of(
    st.none(),
    st.tuples(st.just("prepare"), I64, st.lists(INTS, max_size=4), INTS, INTS, INTS, INTS),
    st.tuples(st.just("patch"), st.lists(st.tuples(I64, I64, I64), max_size=4)),
)
# one strategy per command kind, shaped as its sender builds it (lists / tuples as sent)
COMMANDS = {
    "stop": st.just(("stop",)),
    "zero_kv": st.just(("zero_kv",)),
    "prefill": st.tuples(
        st.just("prefill"), st.lists(st.builds(PrefillChunk, INTS, I64, INTS.map(tuple)))
    ),
    "decode": st.tuples(
        st.just("decode"), st.lists(st.builds(DecodeLane, I64, I64, INTS.map(tuple)))
    ),
    "lease_grant": st.tuples(st.just("lease_grant"), st.text(), st.text(), INTS.map(tuple)),
    "lease_drop": st.tuples(st.just("lease_drop"), st.lists(st.text(), max_size=4)),
    "capture": st.tuples(st.just("capture"), INTS, I64),
    "graph_step": st.tuples(st.just("graph_step"), I64, I64, PREP, I64),
    "write_slots": st.tuples(st.just("write_slots"), INTS, st.lists(ROW, max_size=3)),
    "kv_in": st.tuples(
        st.just("kv_in"), INTS, st.lists(st.tuples(I64, I64, I64, INTS.map(tuple)), max_size=3)
    ),
    "stream_add": st.tuples(st.just("stream_add"), st.text(), st.text(), I64),
    "stream_step": st.tuples(
        st.just("stream_step"),
        st.lists(st.tuples(st.text(), I64, I64, INTS.map(tuple)), max_size=3),
    ),
    "stream_end": st.tuples(st.just("stream_end"), st.text(), I64, st.text(), I64, I64, st.text()),
}
ANY_COMMAND = st.one_of(*COMMANDS.values())
TP_MODULES = [
    "splitserve.engine.tp_control",
    "splitserve.engine.tp_follower",
    "splitserve.engine.tp_channel",
    "splitserve.engine.tp_messages",
    "splitserve.prefill_worker.tp_follower",
    "splitserve.decode_worker.tp_follower",
]


def _pair() -> tuple[FrameSealer, FrameOpener]:
    key = new_control_key(None)
    return FrameSealer(key), FrameOpener(key)


def test_every_command_kind_has_a_strategy():
    assert set(COMMANDS) == set(KIND) and len(set(KIND.values())) == len(KIND)


@settings(max_examples=300, deadline=None)
@given(st.lists(ANY_COMMAND, min_size=1, max_size=4))
def test_every_kind_round_trips_through_a_sealed_frame(commands):
    sealer, opener = _pair()
    for cmd in commands:
        kind, payload = encode_command(cmd)
        assert kind == KIND[cmd[0]]
        assert decode_command(kind, payload) == cmd
        assert opener.open(sealer.seal(kind, payload)) == cmd
    assert opener.next_seq == sealer.next_seq == len(commands)


@settings(max_examples=200, deadline=None)
@given(ANY_COMMAND, st.data())
def test_one_flipped_bit_anywhere_is_refused(cmd, data):
    sealer, opener = _pair()
    frame = bytearray(sealer.seal(*encode_command(cmd)))
    where = data.draw(st.integers(0, len(frame) - 1), label="byte")  # header, payload or tag
    frame[where] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    with pytest.raises(ControlMessageError, match=r"^bad HMAC tag: the message was altered"):
        opener.open(bytes(frame))
    assert opener.next_seq == 0


def test_a_replayed_message_is_refused():
    sealer, opener = _pair()
    frames = [sealer.seal(*encode_command(("lease_drop", [f"L{i}"]))) for i in range(3)]
    assert opener.open(frames[0]) == ("lease_drop", ["L0"])
    assert opener.open(frames[1]) == ("lease_drop", ["L1"])
    for old in frames[:2]:
        with pytest.raises(
            ControlMessageError, match=r"sequence number \d where 2 was expected \(a replayed"
        ):
            opener.open(old)
    assert opener.open(frames[2]) == ("lease_drop", ["L2"])  # the stream goes on in order
    skipped = sealer.seal(*encode_command(("zero_kv",)))  # seq 3, never delivered
    with pytest.raises(ControlMessageError, match="sequence number 4 where 3 was expected"):
        opener.open(sealer.seal(*encode_command(("zero_kv",))))
    assert opener.open(skipped) == ("zero_kv",)


def test_a_message_signed_with_another_key_is_refused():
    secret = b"a-cluster-secret-of-32-characters"
    one, other = new_control_key(secret), new_control_key(secret)
    assert len(one) == len(other) == 32 and one != other  # per launch, even with one secret
    assert new_control_key(None) != new_control_key(None)
    frame = FrameSealer(one).seal(*encode_command(("zero_kv",)))
    assert FrameOpener(one).open(frame) == ("zero_kv",)
    for key in (other, new_control_key(None), bytes(32)):
        with pytest.raises(ControlMessageError, match="not signed with this launch's key"):
            FrameOpener(key).open(frame)
    with pytest.raises(ValueError, match="needs a 32-byte key"):
        FrameOpener(b"")


def _signed(key: bytes, kind: int, payload: bytes, seq: int = 0, version: int = VERSION, n=None):
    """A frame as a sender holding `key` would make it, with any header values."""
    body = HEADER.pack(version, kind, seq, len(payload) if n is None else n) + payload
    return body + hmac.new(key, body, hashlib.sha256).digest()


def _malformed(kind: str, payload: bytes) -> str:
    key = new_control_key(None)
    with pytest.raises(ControlMessageError) as info:
        FrameOpener(key).open(_signed(key, KIND[kind], payload))
    assert "\n" not in str(info.value)  # one log line
    return str(info.value)


def test_unknown_kinds_and_malformed_payloads_are_refused():
    key = new_control_key(None)
    with pytest.raises(ControlMessageError, match="^unknown message kind 99$"):
        FrameOpener(key).open(_signed(key, 99, b""))
    with pytest.raises(ControlMessageError, match="format version 2; this rank reads 1"):
        FrameOpener(key).open(_signed(key, KIND["stop"], b"", version=2))
    with pytest.raises(ControlMessageError, match="header says 5 payload bytes, the frame has 0"):
        FrameOpener(key).open(_signed(key, KIND["stop"], b"", n=5))
    with pytest.raises(ControlMessageError, match="a frame of 47 bytes, shorter than"):
        FrameOpener(key).open(bytes(47))

    _, prefill = encode_command(("prefill", [PrefillChunk([1, 2, 3], 0, (4,))]))
    assert "malformed prefill payload: it ends after" in _malformed("prefill", prefill[:-3])
    assert "malformed prefill payload: 1 bytes are left over" in _malformed(
        "prefill", prefill + b"\0"
    )
    assert "malformed zero_kv payload: 2 bytes are left over" in _malformed("zero_kv", b"ab")
    huge = struct.pack("<I", 2**32 - 1)  # a count no payload can hold
    assert "malformed lease_drop payload: a count of 4294967295 items" in _malformed(
        "lease_drop", huge
    )
    bad_utf8 = struct.pack("<I", 2) + b"\xff\xfe" + struct.pack("<I", 0) + struct.pack("<I", 0)
    assert "malformed lease_grant payload: 'utf-8' codec" in _malformed("lease_grant", bad_utf8)
    assert "malformed graph_step payload: no graph_step prep tag 7" in _malformed(
        "graph_step", struct.pack("<qqB", 1, 0, 7) + struct.pack("<q", 0)
    )
    params = b'{"temperature": -1}'
    row = struct.pack("<I", len(params)) + params + struct.pack("<IIQq", 0, 0, 0, 0)
    refused = _malformed("write_slots", struct.pack("<IqI", 1, 0, 1) + row)
    assert refused.startswith("malformed write_slots payload: 1 validation error for")
    assert "temperature" in refused


def test_a_frame_length_is_checked_before_allocating():
    assert check_frame_length(MIN_FRAME_BYTES) == MIN_FRAME_BYTES
    for n in (-1, 0, MIN_FRAME_BYTES - 1, MAX_FRAME_BYTES + 1, 2**62):
        with pytest.raises(ControlMessageError, match=f"announced frame length {n} outside"):
            check_frame_length(n)


def test_commands_the_format_cannot_carry_fail_on_rank0():
    with pytest.raises(ValueError, match="no tensor-parallel control command 'nope'"):
        encode_command(("nope", 1))
    with pytest.raises(ValueError, match="cannot encode tensor-parallel command 'capture'"):
        encode_command(("capture", [2**63], 1))
    with pytest.raises(ValueError, match="graph_step has no prep 'other'"):
        encode_command(("graph_step", 1, 0, ("other",), 0))


def test_the_key_stays_out_of_reprs():
    key = new_control_key(None)
    for shown in (
        repr(FollowerLaunch("tcp://127.0.0.1:1", key)),
        repr(TPGroup(1, 2, None, None, key)),
    ):
        assert key.hex() not in shown and repr(key) not in shown and "control_key" not in shown


def _pickle_uses(tree: ast.AST) -> list[str]:
    """Names in the code (docstrings aside) that pickle or unpickle: the pickle modules, and
    torch.distributed's *_object / *_object_list collectives."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
        elif isinstance(node, ast.Name | ast.Attribute):
            names = [node.id if isinstance(node, ast.Name) else node.attr]
        else:
            continue
        found += [n for n in names if "pickle" in n.lower() or n.endswith(("_object", "_objects"))]
        found += [n for n in names if n.endswith("_object_list")]
    return found


def test_no_pickle_in_tp_control():
    for name in TP_MODULES:
        tree = ast.parse(inspect.getsource(importlib.import_module(name)))
        assert _pickle_uses(tree) == [], name
    # the check itself finds what the code used before
    old = "dist.broadcast_object_list(box, src=0)\ndist.all_gather_object(p, 1)\nimport pickle"
    assert sorted(_pickle_uses(ast.parse(old))) == [
        "all_gather_object",
        "broadcast_object_list",
        "pickle",
    ]


def test_round_trip_with_pickle_disabled(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used by TP control")

    for attr in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, attr, refuse)
    row = RowInit(SamplingParams(temperature=0.5, logit_bias={7: -3.5}, stop=("x",)), [1], [], 9, 1)
    commands = [
        ("stop",),
        ("zero_kv",),
        ("prefill", [PrefillChunk([1, 2], 0, (3,))]),
        ("decode", [DecodeLane(5, 2, (3,))]),
        ("lease_grant", "L", "R", (1, 2)),
        ("lease_drop", ["L"]),
        ("capture", [1, 2, 4], 2),
        ("graph_step", 2, 4, ("prepare", 4, [[1], [2]], [3, 4], [0, 7], [-1, 0], [0, 8]), 1),
        ("graph_step", 2, 4, ("patch", [(0, 1, 9)]), 0),
        ("graph_step", 2, 0, None, 0),
        ("write_slots", [0], [row]),
        ("kv_in", [1, 2], [(1, 0, 1, (2, 2, 2, 4, 1, 16))]),
        ("stream_add", "R", "secret", 7),
        ("stream_step", [("R", 0, 4, (3, 5))]),
        ("stream_end", "R", 0, "L", 7, 0, ""),
    ]
    assert {c[0] for c in commands} == set(KIND)
    sealer, opener = _pair()
    for cmd in commands:
        assert opener.open(sealer.seal(*encode_command(cmd))) == cmd
