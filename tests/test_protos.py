"""The gRPC contract: generated code is fresh, messages round-trip, the wire layout is
pinned, every rpc documents its deadline and idempotency, and the generated stubs
talk real gRPC."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor as _descriptor

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
FD = _descriptor.FieldDescriptor

needs_tools = pytest.mark.skipif(
    importlib.util.find_spec("grpc_tools") is None,
    reason="grpcio-tools is not installed (pip install -e '.[test]'): "
    "cannot regenerate protos/ to compare",
)


# ---------------------------------------------------------------- generated code


@needs_tools
def test_generated_code_is_not_stale():
    assert build.stale_files() == [], "run `python -m splitserve.protos.build`"


@needs_tools
def test_generation_is_deterministic():
    assert build.generate() == build.generate()


@needs_tools
def test_check_mode_lists_stale_files_and_write_repairs(tmp_path):
    for src in PROTO_DIR.iterdir():
        if src.suffix == ".proto" or build.is_generated_name(src.name):
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
        capture_output=True, text=True, timeout=120,
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


def test_cross_file_imports_use_the_package():
    text = (PROTO_DIR / "worker_pb2.py").read_text()
    assert "from splitserve.protos import generate_pb2" in text
    assert "from splitserve.protos import kv_pb2" in text
    assert worker_pb2.DESCRIPTOR.dependencies[1] is kv_pb2.DESCRIPTOR


# ---------------------------------------------------------------- .proto text


def _protos():
    return {p.name: p.read_text() for p in sorted(PROTO_DIR.glob("*.proto"))}


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
    r"|(?:optional\s+|repeated\s+)?[\w.]+\s+\w+\s*=\s*\d+\s*;"
    r"|[A-Z][A-Z0-9_]*\s*=\s*\d+\s*;)"
)


def test_every_declaration_has_a_comment():
    for name, text in _protos().items():
        lines = text.splitlines()
        assert re.search(r"^package splitserve\.v1;$", text, re.M), name
        assert re.search(r'^syntax = "proto3";$', text, re.M), name
        for i, line in enumerate(lines):
            if DECL.match(line):
                assert _comment_above(lines, i), f"{name}:{i + 1}: no comment above `{line.strip()}`"


# ---------------------------------------------------------------- wire layout

# Field names in field-number order 1..n: renumbering, removing or reordering a field
# breaks the wire contract and must be a deliberate change to this table.
WIRE = {
    "UcxAddress": "host port worker_address",
    "KvShard": "tp_rank tp_size kv_head_start kv_head_end address",
    "KvHandle": "address lease_id request_id num_blocks block_size num_tokens layout dtype "
    "num_layers num_kv_heads head_dim model_compat_hash expires_at_unix_ms ttl_ms shards",
    "TokenIds": "ids",
    "SamplingParams": "max_tokens temperature top_p top_k min_p seed repetition_penalty "
    "presence_penalty frequency_penalty stop stop_token_ids include_stop_str_in_output "
    "ignore_eos logprobs min_tokens",
    "GenerateRequest": "request_id text token_ids sampling skip_special_tokens",
    "TopLogprob": "token_id logprob",
    "TokenLogprob": "token_id logprob top_logprobs",
    "StopReason": "stop_str stop_token_id",
    "Usage": "prompt_tokens cached_prompt_tokens completion_tokens",
    "GenerateResponse": "request_id text token_ids logprobs finish_reason stop_reason usage",
    "AbortRequest": "request_id",
    "AbortResponse": "found",
    "GetServerInfoRequest": "",
    "WorkerInfo": "role address healthy",
    "ServerInfo": "model_name max_model_len vocab_size block_size workers",
    "PrefillRequest": "request_id prompt_token_ids sampling lease_ttl_ms",
    "PrefillResponse": "request_id first_token_id first_token_logprob finish_reason "
    "stop_reason cached_prompt_tokens kv queue_time_ms compute_time_ms",
    "ReleaseLeaseRequest": "lease_id request_id",
    "ReleaseLeaseResponse": "released",
    "DecodeRequest": "request_id prompt_token_ids first_token_id sampling kv",
    "DecodeResponse": "token_ids logprobs finish_reason stop_reason transfer_time_ms queue_time_ms",
    "GetLoadRequest": "max_prefix_hashes",
    "PrefixCacheSummary": "block_hashes num_cached_blocks",
    "WorkerLoad": "role num_running num_waiting free_blocks total_blocks block_size "
    "prefix_cache leases_held model_compat_hash kv_address",
    "KvPullRequest": "lease_id request_id layout dtype block_size num_layers num_kv_heads head_dim "
    "model_compat_hash max_message_bytes",
    "KvPullReply": "status message payload_bytes num_messages num_blocks checksum",
    "KvPullDone": "lease_id ok",
    "RegisterWorkerRequest": "role address",
    "RegisterWorkerResponse": "heartbeat_interval_ms heartbeat_timeout_ms",
    "HeartbeatRequest": "address role",
    "HeartbeatResponse": "known",
}
SERVICES = {
    "GenerateService": "Generate Abort GetServerInfo",
    "PrefillWorker": "Prefill Abort ReleaseLease GetLoad",
    "DecodeWorker": "Decode Abort GetLoad",
    "RouterControl": "RegisterWorker Heartbeat",
}


def _messages():
    for module in PB2_MODULES:
        yield from module.DESCRIPTOR.message_types_by_name.values()


def test_wire_layout_is_pinned():
    layout = {}
    for desc in _messages():
        fields = sorted(desc.fields, key=lambda f: f.number)
        assert [f.number for f in fields] == list(range(1, len(fields) + 1)), desc.name
        layout[desc.name] = " ".join(f.name for f in fields)
    assert layout == WIRE
    services = {}
    for module in PB2_MODULES:
        for svc in module.DESCRIPTOR.services_by_name.values():
            assert svc.full_name == f"splitserve.v1.{svc.name}"
            services[svc.name] = " ".join(m.name for m in svc.methods)
    assert services == SERVICES
    streaming = {m.full_name for m in _all_methods() if m.server_streaming}
    assert streaming == {"splitserve.v1.GenerateService.Generate",
                         "splitserve.v1.DecodeWorker.Decode"}


def _all_methods():
    for module in PB2_MODULES:
        for svc in module.DESCRIPTOR.services_by_name.values():
            yield from svc.methods


def test_enums_start_with_unspecified():
    for module in PB2_MODULES:
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            zero = enum.values_by_number[0].name
            assert zero.endswith("_UNSPECIFIED"), enum.name
            assert all(v.name.startswith(zero.removesuffix("UNSPECIFIED")) for v in enum.values)


# ---------------------------------------------------------------- round trips

_SCALARS = {
    FD.TYPE_STRING: "héllo ✓",
    FD.TYPE_BYTES: b"\x00\xffucx",
    FD.TYPE_BOOL: True,
    FD.TYPE_FLOAT: 0.5,
    FD.TYPE_DOUBLE: 0.25,
    FD.TYPE_UINT32: 2**32 - 1,
    FD.TYPE_FIXED32: 2**32 - 1,
    FD.TYPE_UINT64: 2**64 - 1,
    FD.TYPE_FIXED64: 2**64 - 1,
    FD.TYPE_INT32: -(2**31),
    FD.TYPE_INT64: -(2**63),
}


def _fill(msg, variant: int = 0):
    """Set every field of ``msg`` (recursively) to a non-default value; in a oneof
    with several members, set member number ``variant`` (mod its size)."""
    for field in msg.DESCRIPTOR.fields:
        oneof = field.containing_oneof
        if oneof is not None and len(oneof.fields) > 1:
            if oneof.fields[variant % len(oneof.fields)] is not field:
                continue
        if field.type == FD.TYPE_MESSAGE:
            if field.is_repeated:
                for _ in range(2):
                    _fill(getattr(msg, field.name).add(), variant)
            else:
                sub = getattr(msg, field.name)
                sub.SetInParent()  # set even when the message type has no fields
                _fill(sub, variant)
            continue
        if field.type == FD.TYPE_ENUM:
            value = field.enum_type.values[-1].number
        else:
            value = _SCALARS[field.type]
        if field.is_repeated:
            getattr(msg, field.name).extend([value, value])
        else:
            setattr(msg, field.name, value)
    return msg


def _set_count(msg) -> int:
    n = 0
    for field, value in msg.ListFields():
        n += 1
        if field.type == FD.TYPE_MESSAGE:
            n += sum(_set_count(v) for v in (value if field.is_repeated else [value]))
    return n


@pytest.mark.parametrize("variant", [0, 1])
@pytest.mark.parametrize("name", sorted(WIRE))
def test_every_message_round_trips(name, variant):
    module = next(m for m in PB2_MODULES if name in m.DESCRIPTOR.message_types_by_name)
    msg = _fill(getattr(module, name)(), variant)
    data = msg.SerializeToString(deterministic=True)
    back = getattr(module, name).FromString(data)
    assert back == msg
    assert _set_count(back) == _set_count(msg)
    assert back.SerializeToString(deterministic=True) == data
    top_level = [f for f in msg.DESCRIPTOR.fields
                 if f.containing_oneof is None or len(f.containing_oneof.fields) == 1]
    assert {f.name for f, _ in back.ListFields()} >= {f.name for f in top_level}


def test_optional_fields_keep_presence_of_zero():
    sp = generate_pb2.SamplingParams(seed=0, temperature=0.0, logprobs=0)
    back = generate_pb2.SamplingParams.FromString(sp.SerializeToString())
    assert back.HasField("seed") and back.seed == 0
    assert back.HasField("temperature") and back.HasField("logprobs")
    assert not back.HasField("top_p") and not back.HasField("max_tokens")
    req = generate_pb2.GenerateRequest.FromString(
        generate_pb2.GenerateRequest(skip_special_tokens=False).SerializeToString())
    assert req.HasField("skip_special_tokens") and not req.skip_special_tokens


def test_prompt_and_stop_reason_are_oneofs():
    req = generate_pb2.GenerateRequest(text="hi")
    req.token_ids.ids.extend([1, 2, 3])
    back = generate_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("prompt") == "token_ids" and back.text == ""
    stop = generate_pb2.StopReason(stop_str="###")
    stop.stop_token_id = 2
    assert stop.WhichOneof("reason") == "stop_token_id"


def test_kv_handle_example():
    handle = kv_pb2.KvHandle(
        address=kv_pb2.UcxAddress(host="10.0.0.5", port=13337),
        lease_id="lease-1", request_id="req-1",
        num_blocks=3, block_size=16, num_tokens=40,
        layout=kv_pb2.KV_LAYOUT_LAYER_KV_BLOCK_TOKEN_HEAD_DIM, dtype=kv_pb2.KV_DTYPE_BF16,
        num_layers=32, num_kv_heads=8, head_dim=128, model_compat_hash="sha256:ab12",
        expires_at_unix_ms=1_700_000_030_000, ttl_ms=30_000,
        shards=[kv_pb2.KvShard(tp_rank=r, tp_size=2, kv_head_start=4 * r, kv_head_end=4 * r + 4,
                               address=kv_pb2.UcxAddress(host="10.0.0.5", port=13337 + r))
                for r in range(2)],
    )
    resp = worker_pb2.PrefillResponse(request_id="req-1", first_token_id=42, kv=handle)
    back = worker_pb2.PrefillResponse.FromString(resp.SerializeToString())
    assert back.kv == handle and back.HasField("kv")
    assert back.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED
    assert kv_pb2.KvDtype.Name(back.kv.dtype) == "KV_DTYPE_BF16"
    assert [s.kv_head_end for s in back.kv.shards] == [4, 8]


# ---------------------------------------------------------------- real gRPC


class _Servicer(generate_pb2_grpc.GenerateServiceServicer):
    async def GetServerInfo(self, request, context):
        return generate_pb2.ServerInfo(
            model_name="tiny-llama", max_model_len=256, vocab_size=512, block_size=16,
            workers=[generate_pb2.WorkerInfo(role=generate_pb2.WORKER_ROLE_PREFILL,
                                             address="127.0.0.1:50061", healthy=True)],
        )

    async def Generate(self, request, context):
        ids = list(request.token_ids.ids)
        yield generate_pb2.GenerateResponse(request_id=request.request_id, token_ids=ids[:1])
        yield generate_pb2.GenerateResponse(
            request_id=request.request_id, token_ids=ids[1:],
            finish_reason=generate_pb2.FINISH_REASON_LENGTH,
            usage=generate_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(ids)),
        )


async def _smoke():
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(_Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            info = await stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=10)
            req = generate_pb2.GenerateRequest(request_id="r1",
                                               token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]))
            chunks = [c async for c in stub.Generate(req, timeout=10)]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Abort(generate_pb2.AbortRequest(request_id="r1"), timeout=10)
        return info, chunks, err.value.code()
    finally:
        await server.stop(grace=None)


def test_generated_stubs_talk_real_grpc():
    info, chunks, abort_code = asyncio.run(_smoke())
    assert info.model_name == "tiny-llama" and info.block_size == 16
    assert info.workers[0].role == generate_pb2.WORKER_ROLE_PREFILL and info.workers[0].healthy
    assert [list(c.token_ids) for c in chunks] == [[5], [6, 7]]
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.prompt_tokens == 3
    assert abort_code == grpc.StatusCode.UNIMPLEMENTED  # the generated base servicer
