"""The test's hands inside the router's namespace (the pytest process itself stays in the root
namespace, from which 198.18.0.0/24 is unreachable). Runs as
`ip netns exec NS python netns_driver.py`, reads one JSON command per stdin line, answers with
JSON lines on stdout, each tagged with the command's "tag":

    {"op": "generate", "router": A, "ids": [...], "max_tokens": N, "request_id": R, "key": K}
        -> {"event": "tokens", "ids": [...]} per chunk, then {"event": "end", "code": "OK"|NAME, "details": ...}
    {"op": "info", "router": A, "key": K}      -> {"workers": [[role, address, healthy], ...]}
                                                  (or {"error": NAME})
    {"op": "load", "address": A, "role": R, "key": K}  -> WorkerLoad as JSON (or {"error": ...})
    {"op": "health", "address": A}             -> {"status": NAME | None}
    {"op": "metrics", "url": U}                -> {"text": ...}

"key" (optional) goes as `authorization: Bearer K`: an API key to the router, the cluster secret
to a worker. Commands run concurrently (a stream keeps going while the test polls the router).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import urllib.request

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.protos import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc


def say(tag, **msg) -> None:
    print(json.dumps({"tag": tag, **msg}), flush=True)


def auth(cmd: dict) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {cmd['key']}"),) if cmd.get("key") else None


async def generate(cmd: dict) -> None:
    tag = cmd["tag"]
    req = generate_pb2.GenerateRequest(
        request_id=cmd.get("request_id", ""),
        token_ids=generate_pb2.TokenIds(ids=cmd["ids"]),
        sampling=generate_pb2.SamplingParams(
            temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True
        ),
    )
    streamed = None  # the final chunk's kv_handover.streamed (None: no hand-over reported)
    async with grpc.aio.insecure_channel(cmd["router"]) as ch:
        try:
            async for chunk in generate_pb2_grpc.GenerateServiceStub(ch).Generate(
                req, timeout=cmd.get("timeout", 60), metadata=auth(cmd)
            ):
                say(tag, event="tokens", ids=list(chunk.token_ids))
                if chunk.HasField("kv_handover"):
                    streamed = chunk.kv_handover.streamed
            say(tag, event="end", code="OK", details="", streamed=streamed)
        except grpc.aio.AioRpcError as err:
            say(tag, event="end", code=err.code().name, details=err.details())


async def info(cmd: dict) -> None:
    async with grpc.aio.insecure_channel(cmd["router"]) as ch:
        try:
            got = await generate_pb2_grpc.GenerateServiceStub(ch).GetServerInfo(
                generate_pb2.GetServerInfoRequest(), timeout=5, metadata=auth(cmd)
            )
        except grpc.aio.AioRpcError as err:
            return say(cmd["tag"], error=err.code().name)
    say(cmd["tag"], workers=[[w.role, w.address, w.healthy] for w in got.workers])


async def load(cmd: dict) -> None:
    stub = (
        worker_pb2_grpc.PrefillWorkerStub
        if cmd["role"] == "prefill"
        else worker_pb2_grpc.DecodeWorkerStub
    )
    async with grpc.aio.insecure_channel(cmd["address"]) as ch:
        try:
            got = await stub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=3, metadata=auth(cmd))
        except grpc.aio.AioRpcError as err:
            return say(cmd["tag"], error=err.code().name)
    say(
        cmd["tag"],
        load=MessageToDict(
            got, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        ),
    )


async def health(cmd: dict) -> None:
    async with grpc.aio.insecure_channel(cmd["address"]) as ch:
        try:
            got = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(got.status)
        except grpc.aio.AioRpcError:
            status = None
    say(cmd["tag"], status=status)


async def metrics(cmd: dict) -> None:
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(cmd["url"], timeout=5).read().decode()
    )
    say(cmd["tag"], text=text)


OPS = {"generate": generate, "info": info, "load": load, "health": health, "metrics": metrics}


async def main() -> None:
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()

    def read() -> None:  # stdin in a thread: the event loop never blocks on it
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read, daemon=True).start()
    tasks = set()
    say(None, event="ready")
    while (line := await lines.get()) is not None:
        cmd = json.loads(line)

        async def run(cmd=cmd) -> None:
            try:
                await OPS[cmd["op"]](cmd)
            except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
                say(cmd["tag"], error=f"{type(exc).__name__}: {exc}")

        task = asyncio.create_task(run())
        tasks.add(task)
        task.add_done_callback(tasks.discard)


if __name__ == "__main__":
    asyncio.run(main())
