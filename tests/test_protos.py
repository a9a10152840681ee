"""The gRPC contract: the .proto files sit under their package so a plain `protoc -I protos`
compiles them, the generated Python is fresh and imports as `splitserve.protos`, every rpc
documents its deadline and idempotency, and the wire layout (field numbers, reserved
numbers) is pinned. The messages in use are tested in test_proto_messages.py."""

from __future__ import annotations

import importlib.util
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf import descriptor_pb2, descriptor_pool

from splitserve.protos import (
    build,
    generate_pb2,
    generate_pb2_grpc,
    kv_pb2,
    kv_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

PROTO_DIR = Path(build.__file__).resolve().parent
PB2_MODULES = (generate_pb2, kv_pb2, worker_pb2, router_pb2)
GRPC_MODULES = (generate_pb2_grpc, kv_pb2_grpc, worker_pb2_grpc, router_pb2_grpc)
PROTO_FILES = [f"splitserve/v1/{n}.proto" for n in ("generate", "kv", "router", "worker")]

needs_tools = pytest.mark.skipif(
    importlib.util.find_spec("grpc_tools") is None,
    reason="grpcio-tools is not installed (pip install -e '.[test]'): "
    "cannot regenerate protos/ to compare",
)


# ---------------------------------------------------------------- layout: any language


def test_files_sit_under_their_package():
    files = sorted(p.relative_to(PROTO_DIR).as_posix() for p in PROTO_DIR.rglob("*.proto"))
    assert files == PROTO_FILES
    for rel in files:
        text = (PROTO_DIR / rel).read_text()
        package = re.search(r"^package ([\w.]+);$", text, re.M)[1]
        assert Path(rel).parent.as_posix() == package.replace(".", "/"), rel
        for imported in re.findall(r'^import "([^"]+)";$', text, re.M):
            assert imported in PROTO_FILES, f"{rel}: import {imported!r} is not protos/-relative"


@needs_tools
def test_plain_protoc_compiles_every_proto_from_a_clone(tmp_path):
    # What Go / Node / Rust tooling runs: `-I protos` and nothing else. `python -m
    # grpc_tools.protoc` adds only its well-known types, which protoc binaries carry built in.
    clone = tmp_path / "clone"
    shutil.copytree(PROTO_DIR / "splitserve", clone / "protos" / "splitserve")
    out = tmp_path / "all.pb"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            "protos",
            f"--descriptor_set_out={out}",
            *(f"protos/{rel}" for rel in PROTO_FILES),
        ],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    messages = [m for f in compiled for m in f.message_type]
    for msg in messages:  # protoc's Python output leaves json_name out (the name implies it)
        messages.extend(msg.nested_type)
        for field in msg.field:
            field.ClearField("json_name")
    # the Python modules carry exactly what other languages compile
    assert {f.name: f for f in compiled} == {
        m.DESCRIPTOR.name: descriptor_pb2.FileDescriptorProto.FromString(m.DESCRIPTOR.serialized_pb)
        for m in PB2_MODULES
    }


def test_a_proto_outside_the_package_folder_is_refused(tmp_path):
    (tmp_path / "splitserve" / "v1").mkdir(parents=True)
    (tmp_path / "kv.proto").write_text('syntax = "proto3";\n')  # the old flat layout
    with pytest.raises(build.BuildError, match="move or remove: kv.proto"):
        build.proto_files(tmp_path)


# ---------------------------------------------------------------- generated code


@needs_tools
def test_generated_code_is_not_stale():
    assert build.stale_files() == [], "run `python -m splitserve.protos.build`"


@needs_tools
def test_generation_is_deterministic():
    assert build.generate() == build.generate()


@needs_tools
def test_check_mode_lists_stale_files_and_write_repairs(tmp_path):
    shutil.copytree(PROTO_DIR / build.PROTO_PACKAGE, tmp_path / build.PROTO_PACKAGE)
    for src in PROTO_DIR.iterdir():
        if build.is_generated_name(src.name):
            shutil.copy2(src, tmp_path / src.name)
    (tmp_path / "kv_pb2.py").write_bytes(b"# edited by hand\n")
    (tmp_path / "worker_pb2.pyi").unlink()
    (tmp_path / "old_pb2.py").write_text("# from a deleted old.proto\n")
    assert build.stale_files(tmp_path) == [
        "kv_pb2.py (differs)",
        "old_pb2.py (no .proto produces it)",
        "worker_pb2.pyi (missing)",
    ]
    assert len(build.write(tmp_path)) == 3
    assert build.stale_files(tmp_path) == []


@needs_tools
def test_check_command_runs_as_a_script():
    done = subprocess.run(
        [sys.executable, str(PROTO_DIR / "build.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stdout


def test_tools_version_is_checked_with_one_clear_line(monkeypatch):
    monkeypatch.setattr(build.importlib.metadata, "version", lambda name: "1.85.0")
    message = build.tools_version_error()
    assert message is not None and "\n" not in message
    assert "1.85.0" in message and "grpcio-tools==1.84.*" in message
    monkeypatch.setattr(build.importlib.metadata, "version", lambda name: "1.84.2")
    assert build.tools_version_error() is None


@pytest.mark.parametrize("module", GRPC_MODULES, ids=lambda m: m.__name__)
def test_grpc_gencode_targets_grpcio_1_84(module):
    # The GPU machine runs grpcio 1.84.0: the stamp must be the series floor, not the
    # tools' patch version, or the stubs refuse to import there.
    assert module.GRPC_GENERATED_VERSION.startswith("1.84")
    assert module.GRPC_GENERATED_VERSION == build.GRPC_VERSION_FLOOR == "1.84.0"


def test_generated_code_imports_splitserve_protos():
    # protoc names modules after the .proto path (splitserve.v1.*); build.py rewrites that.
    text = (PROTO_DIR / "worker_pb2.py").read_text()
    assert "from splitserve.protos import generate_pb2" in text
    assert "from splitserve.protos import kv_pb2" in text
    for path in sorted(PROTO_DIR.iterdir()):
        if build.is_generated_name(path.name):
            assert not re.search(
                r"splitserve\.v1 import|'splitserve\.v1\.\w+_pb2'", path.read_text()
            )
    assert worker_pb2.DESCRIPTOR.name == "splitserve/v1/worker.proto"  # as in every language
    assert worker_pb2.DESCRIPTOR.dependencies[1] is kv_pb2.DESCRIPTOR
    assert worker_pb2.PrefillRequest.__module__ == "splitserve.protos.worker_pb2"
    msg = worker_pb2.PrefillRequest(request_id="r1", prompt_token_ids=[1, 2])
    assert pickle.loads(pickle.dumps(msg)) == msg  # needs an importable __module__


# ---------------------------------------------------------------- .proto text


def _protos():
    return {p.name: p.read_text() for p in build.proto_files()}


def _comment_above(lines: list[str], i: int) -> list[str]:
    block = []
    while i > 0 and lines[i - 1].strip().startswith("//"):
        i -= 1
        block.insert(0, lines[i].strip())
    return block


def test_every_rpc_states_deadline_and_idempotency():
    rpcs = 0
    for name, text in _protos().items():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"\s*rpc\s+(\w+)\s*\(", line)
            if not m:
                continue
            rpcs += 1
            comment = " ".join(_comment_above(lines, i))
            assert "Deadline:" in comment, f"{name}: rpc {m[1]} has no 'Deadline:' comment"
            assert "Idempotency:" in comment, f"{name}: rpc {m[1]} has no 'Idempotency:' comment"
    assert rpcs == 3 + 4 + 3 + 2


DECL = re.compile(
    r"\s*(?:(?:message|enum|service|oneof)\s+\w+\s*\{"
    r"|(?:optional\s+|repeated\s+)?[\w.]+\s+\w+\s*=\s*\d+\s*(?:\[[^\]]*\]\s*)?;"
    r"|[A-Z][A-Z0-9_]*\s*=\s*\d+\s*;)"
)


def test_every_declaration_has_a_comment():
    for name, text in _protos().items():
        lines = text.splitlines()
        assert re.search(r"^package splitserve\.v1;$", text, re.M), name
        assert re.search(r'^syntax = "proto3";$', text, re.M), name
        for i, line in enumerate(lines):
            if DECL.match(line):
                assert _comment_above(lines, i), (
                    f"{name}:{i + 1}: no comment above `{line.strip()}`"
                )


# ---------------------------------------------------------------- wire layout

# Every message's fields and every enum's values as name=number in number order, then
# "| reserved <numbers> <names>" once one is retired. A pair here never changes: retire a
# field by deleting it AND reserving its number and name in the .proto (its pair leaves,
# "| reserved" grows); a new field takes a new number. The rule: protos/README.md.
WIRE = {
    "FinishReason": "FINISH_REASON_UNSPECIFIED=0 FINISH_REASON_STOP=1 FINISH_REASON_LENGTH=2 "
    "FINISH_REASON_ABORT=3",
    "WorkerRole": "WORKER_ROLE_UNSPECIFIED=0 WORKER_ROLE_PREFILL=1 WORKER_ROLE_DECODE=2",
    "TokenIds": "ids=1",
    "SamplingParams": "max_tokens=1 temperature=2 top_p=3 top_k=4 min_p=5 seed=6 "
    "repetition_penalty=7 presence_penalty=8 frequency_penalty=9 stop=10 stop_token_ids=11 "
    "include_stop_str_in_output=12 ignore_eos=13 logprobs=14 min_tokens=15 logit_bias=16 "
    "json_schema=17 json_object=18 regex=19 choice=20 grammar=21 json_whitespace=22",
    "ChoiceConstraint": "choices=1",
    "GenerateRequest": "request_id=1 text=2 token_ids=3 sampling=4 skip_special_tokens=5",
    "TopLogprob": "token_id=1 logprob=2",
    "TokenLogprob": "token_id=1 logprob=2 top_logprobs=3",
    "StopReason": "stop_str=1 stop_token_id=2",
    "Usage": "prompt_tokens=1 cached_prompt_tokens=2 completion_tokens=3",
    "GenerateResponse": "request_id=1 text=2 token_ids=3 logprobs=4 finish_reason=5 "
    "stop_reason=6 usage=7 kv_handover=8 timings=9",
    "RequestTimings": "router_queue_ms=1 prefill_queue_ms=2 prefill_compute_ms=3 "
    "prefill_sampling_ms=4 first_token_delivery_ms=5 second_token_gap_ms=6 handover_ms=7 "
    "first_decode_step_ms=8 second_token_delivery_ms=9 reserve_wait_ms=10",
    "KvHandover": "recomputed=1 reason=2 transfer_ms=3 streamed=4 stream_fallback=5",
    "AbortRequest": "request_id=1",
    "AbortResponse": "found=1",
    "GetServerInfoRequest": "",
    "WorkerInfo": "role=1 address=2 healthy=3",
    "ServerInfo": "model_name=1 max_model_len=2 vocab_size=3 block_size=4 workers=5",
    "KvLayout": "KV_LAYOUT_UNSPECIFIED=0 KV_LAYOUT_LAYER_KV_BLOCK_TOKEN_HEAD_DIM=1",
    "KvDtype": "KV_DTYPE_UNSPECIFIED=0 KV_DTYPE_FP32=1 KV_DTYPE_FP16=2 KV_DTYPE_BF16=3",
    "KvPullStatus": "KV_PULL_STATUS_UNSPECIFIED=0 KV_PULL_STATUS_OK=1 "
    "KV_PULL_STATUS_LEASE_UNKNOWN=2 KV_PULL_STATUS_LEASE_EXPIRED=3 KV_PULL_STATUS_INCOMPATIBLE=4 "
    "KV_PULL_STATUS_ABORTED=5",
    "UcxAddress": "host=1 port=2 worker_address=3",
    "KvShard": "tp_rank=1 tp_size=2 kv_head_start=3 kv_head_end=4 address=5",
    "KvHandle": "address=1 lease_id=2 request_id=3 num_blocks=4 block_size=5 num_tokens=6 "
    "layout=7 dtype=8 num_layers=9 num_kv_heads=10 head_dim=11 model_compat_hash=12 "
    "expires_at_unix_ms=13 ttl_ms=14 shards=15",
    "KvPullRequest": "lease_id=1 request_id=2 layout=3 dtype=4 block_size=5 num_layers=6 "
    "num_kv_heads=7 head_dim=8 model_compat_hash=9 max_message_bytes=10 stream=11 num_tokens=12 "
    "stream_token=13 skip_checksum=14",
    "KvPullReply": "status=1 message=2 payload_bytes=3 num_messages=4 num_blocks=5 checksum=6",
    "KvPullDone": "lease_id=1 ok=2",
    "KvStreamPiece": "layer_start=1 layer_end=2 block_start=3 block_end=4 payload_bytes=5 "
    "checksum=6 final=7 status=8 message=9 first_token_id=10 finished=11 lease_id=12",
    "PrefillRequest": "request_id=1 prompt_token_ids=2 sampling=3 lease_ttl_ms=4 kv_stream_token=5",
    "PrefillResponse": "request_id=1 first_token_id=2 first_token_logprob=3 finish_reason=4 "
    "stop_reason=5 cached_prompt_tokens=6 kv=7 queue_time_ms=8 compute_time_ms=9 "
    "sampling_time_ms=10 handover_start_ms=11",
    "ReleaseLeaseRequest": "lease_id=1 request_id=2",
    "ReleaseLeaseResponse": "released=1",
    "DecodeRequest": "request_id=1 prompt_token_ids=2 first_token_id=3 sampling=4 kv=5 kv_stream=6",
    "KvStreamSource": "address=1 model_compat_hash=2 token=3 shards=4",
    "DecodeResponse": "token_ids=1 logprobs=2 finish_reason=3 stop_reason=4 transfer_time_ms=5 "
    "queue_time_ms=6 kv_recomputed=7 kv_recompute_reason=8 kv_stream_fallback=9 kv_streamed=10 "
    "admit_wait_ms=11 local_prefill_ms=12 reserve_wait_ms=13",
    "GetLoadRequest": "max_prefix_hashes=1",
    "PrefixCacheSummary": "block_hashes=1 num_cached_blocks=2 block_keys=3",
    "WorkerLoad": "role=1 num_running=2 num_waiting=3 free_blocks=4 total_blocks=5 block_size=6 "
    "prefix_cache=7 leases_held=8 model_compat_hash=9 kv_address=10 kv_streaming=11 kv_shards=12",
    "RegisterWorkerRequest": "role=1 address=2",
    "RegisterWorkerResponse": "heartbeat_interval_ms=1 heartbeat_timeout_ms=2",
    "HeartbeatRequest": "address=1 role=2",
    "HeartbeatResponse": "known=1",
}
SERVICES = {
    "GenerateService": "Generate Abort GetServerInfo",
    "PrefillWorker": "Prefill Abort ReleaseLease GetLoad",
    "DecodeWorker": "Decode Abort GetLoad",
    "RouterControl": "RegisterWorker Heartbeat",
}


def _types():
    for module in PB2_MODULES:
        yield from module.DESCRIPTOR.enum_types_by_name.values()
        yield from module.DESCRIPTOR.message_types_by_name.values()


def _wire(desc) -> tuple[str, list[str]]:
    """(``WIRE``'s string for ``desc``, the numbering rule's complaints)."""
    is_enum = isinstance(desc, _descriptor.EnumDescriptor)
    proto = descriptor_pb2.EnumDescriptorProto() if is_enum else descriptor_pb2.DescriptorProto()
    desc.CopyToProto(proto)
    live = sorted((f.number, f.name) for f in (proto.value if is_enum else proto.field))
    # a message's reserved range ends one past its last number, an enum's at it
    reserved = [(r.start, r.end if is_enum else r.end - 1) for r in proto.reserved_range]
    text = " ".join(f"{name}={number}" for number, name in live)
    if reserved or proto.reserved_name:
        text += " | reserved " + " ".join(
            [str(a) if a == b else f"{a}-{b}" for a, b in reserved] + list(proto.reserved_name)
        )
    taken = {n for n, _ in live}
    top = max(taken, default=0)
    held = {n for a, b in reserved for n in range(a, min(b, top) + 1)}  # `to max` stays cheap
    problems = [
        f"{n} dropped without `reserved`"
        for n in range(0 if is_enum else 1, top)
        if n not in taken | held
    ]
    problems += [f"{n} is reserved" for n in sorted(taken & held)]
    return text, problems + [f"{n} is reserved" for _, n in live if n in proto.reserved_name]


def test_wire_layout_is_pinned():
    assert {d.name: _wire(d)[0] for d in _types()} == WIRE
    assert {d.name: _wire(d)[1] for d in _types() if _wire(d)[1]} == {}
    services = [s for m in PB2_MODULES for s in m.DESCRIPTOR.services_by_name.values()]
    assert {s.name: " ".join(m.name for m in s.methods) for s in services} == SERVICES
    assert all(s.full_name == f"splitserve.v1.{s.name}" for s in services)
    streaming = {m.full_name for s in services for m in s.methods if m.server_streaming}
    assert streaming == {
        "splitserve.v1.GenerateService.Generate",
        "splitserve.v1.DecodeWorker.Decode",
    }


def _toy(fields: dict[str, int], reserved=(), names=()):
    """Message toy.Toy with ``fields``, ``reserved`` [start, end) ranges and names."""
    fdp = descriptor_pb2.FileDescriptorProto(name="toy.proto", package="toy", syntax="proto3")
    msg = fdp.message_type.add(name="Toy")
    fd = descriptor_pb2.FieldDescriptorProto
    for name, number in fields.items():
        msg.field.add(name=name, number=number, type=fd.TYPE_UINT32, label=fd.LABEL_OPTIONAL)
    for start, end in reserved:
        msg.reserved_range.add(start=start, end=end)
    msg.reserved_name.extend(names)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(fdp.SerializeToString())
    return pool.FindMessageTypeByName("toy.Toy")


def test_retiring_a_field_reserves_its_number_and_reuse_is_refused():
    assert _wire(_toy({"a": 1, "b": 2, "c": 3})) == ("a=1 b=2 c=3", [])
    retired = _toy({"a": 1, "c": 3}, reserved=[(2, 3)], names=["b"])
    assert _wire(retired) == ("a=1 c=3 | reserved 2 b", [])
    assert _wire(_toy({"a": 1, "c": 3}))[1] == ["2 dropped without `reserved`"]
    reused = _toy({"a": 1, "d": 2, "c": 3}, reserved=[(2, 3)], names=["b"])
    assert _wire(reused)[1] == ["2 is reserved"]  # protoc refuses this .proto too
    # reusing a number that was never reserved changes its pinned pair: WIRE fails
    assert _wire(_toy({"a": 1, "d": 2, "c": 3}))[0] != "a=1 b=2 c=3"


def test_enums_start_with_unspecified():
    for module in PB2_MODULES:
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            zero = enum.values_by_number[0].name
            assert zero.endswith("_UNSPECIFIED"), enum.name
            assert all(v.name.startswith(zero.removesuffix("UNSPECIFIED")) for v in enum.values)


def test_64_bit_prefix_hashes_are_deprecated_for_16_byte_keys():
    fields = worker_pb2.PrefixCacheSummary.DESCRIPTOR.fields_by_name
    assert fields["block_hashes"].GetOptions().deprecated  # kept (number 1 never reused), unfilled
    keys = fields["block_keys"]
    assert keys.type == _descriptor.FieldDescriptor.TYPE_BYTES and not keys.GetOptions().deprecated
