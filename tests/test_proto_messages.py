"""The generated messages and stubs in use: every message round-trips with every field
set, optional fields keep presence, oneofs hold one member, and the stubs talk real gRPC.
(The contract itself, layout and wire pins are in test_protos.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import descriptor as _descriptor

from splitserve.protos import generate_pb2, generate_pb2_grpc, kv_pb2, router_pb2, worker_pb2

PB2_MODULES = (generate_pb2, kv_pb2, worker_pb2, router_pb2)
MESSAGES = sorted(name for m in PB2_MODULES for name in m.DESCRIPTOR.message_types_by_name)
FD = _descriptor.FieldDescriptor

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
        if oneof is not None and oneof.fields[variant % len(oneof.fields)] is not field:
            continue  # another member of this oneof is the one set
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, val = (
                field.message_type.fields_by_name["key"],
                field.message_type.fields_by_name["value"],
            )
            getattr(msg, field.name)[_SCALARS[key.type]] = _SCALARS[val.type]  # scalar maps only
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
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            n += len(value)  # scalar map: its entries
        elif field.type == FD.TYPE_MESSAGE:
            n += sum(_set_count(v) for v in (value if field.is_repeated else [value]))
    return n


@pytest.mark.parametrize("variant", [0, 1])
@pytest.mark.parametrize("name", MESSAGES)
def test_every_message_round_trips(name, variant):
    module = next(m for m in PB2_MODULES if name in m.DESCRIPTOR.message_types_by_name)
    msg = _fill(getattr(module, name)(), variant)
    data = msg.SerializeToString(deterministic=True)
    back = getattr(module, name).FromString(data)
    assert back == msg
    assert _set_count(back) == _set_count(msg)
    assert back.SerializeToString(deterministic=True) == data
    top_level = [
        f
        for f in msg.DESCRIPTOR.fields
        if f.containing_oneof is None or len(f.containing_oneof.fields) == 1
    ]
    assert {f.name for f, _ in back.ListFields()} >= {f.name for f in top_level}


def test_optional_fields_keep_presence_of_zero():
    sp = generate_pb2.SamplingParams(seed=0, temperature=0.0, logprobs=0)
    back = generate_pb2.SamplingParams.FromString(sp.SerializeToString())
    assert back.HasField("seed") and back.seed == 0
    assert back.HasField("temperature") and back.HasField("logprobs")
    assert not back.HasField("top_p") and not back.HasField("max_tokens")
    req = generate_pb2.GenerateRequest.FromString(
        generate_pb2.GenerateRequest(skip_special_tokens=False).SerializeToString()
    )
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
        lease_id="lease-1",
        request_id="req-1",
        num_blocks=3,
        block_size=16,
        num_tokens=40,
        layout=kv_pb2.KV_LAYOUT_LAYER_KV_BLOCK_TOKEN_HEAD_DIM,
        dtype=kv_pb2.KV_DTYPE_BF16,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        model_compat_hash="sha256:ab12",
        expires_at_unix_ms=1_700_000_030_000,
        ttl_ms=30_000,
        shards=[
            kv_pb2.KvShard(
                tp_rank=r,
                tp_size=2,
                kv_head_start=4 * r,
                kv_head_end=4 * r + 4,
                address=kv_pb2.UcxAddress(host="10.0.0.5", port=13337 + r),
            )
            for r in range(2)
        ],
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
            model_name="tiny-llama",
            max_model_len=256,
            vocab_size=512,
            block_size=16,
            workers=[
                generate_pb2.WorkerInfo(
                    role=generate_pb2.WORKER_ROLE_PREFILL, address="127.0.0.1:50061", healthy=True
                )
            ],
        )

    async def Generate(self, request, context):
        ids = list(request.token_ids.ids)
        yield generate_pb2.GenerateResponse(request_id=request.request_id, token_ids=ids[:1])
        yield generate_pb2.GenerateResponse(
            request_id=request.request_id,
            token_ids=ids[1:],
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
            req = generate_pb2.GenerateRequest(
                request_id="r1", token_ids=generate_pb2.TokenIds(ids=[5, 6, 7])
            )
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
