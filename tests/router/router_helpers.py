"""Shared pieces of the router tests: worker flags, an in-process router on a real grpc.aio
server, stream collection, the oracle, and the end-of-test "every worker's KV is free" check."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers_procs import ProcessGroup

from splitserve.config.engine_config import EngineConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.offline import OfflineEngine
from splitserve.protos import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.tokenizer import Tokenizer
from splitserve.router.config import RouterConfig
from splitserve.router.server import Router
from splitserve.service.grpc_service import channel_options

BLOCK_SIZE = 4
MAX_MODEL_LEN = 256
SERVING = health_pb2.HealthCheckResponse.SERVING


def worker_flags(num_blocks: int = 128) -> list[str]:
    return [
        "--num-blocks",
        str(num_blocks),
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]


@dataclass
class Cluster:
    model: Path
    prefill: str
    decode: str
    procs: ProcessGroup
    decode_metrics_port: int | None = None

    async def assert_free(self, timeout: float = 10.0) -> None:
        await assert_workers_free([self.prefill], [self.decode], timeout)

    def decode_finished(self, reason: str) -> float:
        """The decode worker's count of requests it ended with `reason` (from its /metrics)."""
        import re
        import urllib.request

        url = f"http://127.0.0.1:{self.decode_metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        m = re.search(
            rf'splitserve_decode_requests_finished_total{{reason="{reason}"}} ([0-9.e+]+)', text
        )
        return float(m.group(1)) if m else 0.0


def router_config(model, prefill=(), decode=(), **kw: Any) -> RouterConfig:
    registry = {"poll_interval_s": 0.2, "probe_timeout_s": 2.0, **kw.pop("registry", {})}
    return RouterConfig.model_validate(
        {
            "model_path": str(model),
            "max_model_len": MAX_MODEL_LEN,
            "server": {
                "host": "127.0.0.1",
                "port": 0,
                "drain_grace_s": 1.0,
                **kw.pop("server", {}),
            },
            "workers": {"prefill": list(prefill), "decode": list(decode)},
            "registry": registry,
            **kw,
        }
    )


async def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_router(cfg: RouterConfig, ready: bool = True):
    """Yields (router, GenerateService stub); waits for health SERVING unless ready=False."""
    router = Router(cfg)
    await router.start()
    channel = grpc.aio.insecure_channel(router.address, options=channel_options())
    try:
        if ready:
            health = health_pb2_grpc.HealthStub(channel)

            async def serving() -> bool:
                return (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING

            await wait_until(serving, what="router health SERVING")
        yield router, generate_pb2_grpc.GenerateServiceStub(channel)
        await wait_until(
            lambda: not router.generate.live and not len(router.ctx.background),
            5.0,
            "router idle (no live request, no pending release)",
        )
    finally:
        await channel.close()
        await router.stop(grace_s=1.0)


def greedy(max_tokens: int, **kw: Any) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def text_request(text: str, sampling: generate_pb2.SamplingParams, request_id: str = "", **kw: Any):
    return generate_pb2.GenerateRequest(request_id=request_id, text=text, sampling=sampling, **kw)


def ids_request(ids, sampling: generate_pb2.SamplingParams, request_id: str = "", **kw: Any):
    return generate_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=generate_pb2.TokenIds(ids=list(ids)),
        sampling=sampling,
        **kw,
    )


@dataclass
class Result:
    chunks: list[generate_pb2.GenerateResponse]

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def last(self) -> generate_pb2.GenerateResponse:
        return self.chunks[-1]


async def generate(stub, request, timeout: float = 30.0) -> Result:
    return Result([c async for c in stub.Generate(request, timeout=timeout)])


async def read_rest(call) -> list[generate_pb2.GenerateResponse]:
    """The remaining chunks of a call read with `read()` (grpc.aio does not mix read() and async for)."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def rpc_error(coro) -> grpc.aio.AioRpcError:
    try:
        await coro
    except grpc.aio.AioRpcError as err:
        return err
    raise AssertionError("the call succeeded; an error status was expected")


async def worker_load(address: str, role: str) -> worker_pb2.WorkerLoad:
    stub_cls = (
        worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    )
    secret = os.environ.get("SPLITSERVE_CLUSTER_SECRET")  # workers started with one need it
    metadata = (("authorization", f"Bearer {secret}"),) if secret else None
    async with grpc.aio.insecure_channel(address) as ch:
        return await stub_cls(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5, metadata=metadata)


def _free(load: worker_pb2.WorkerLoad) -> bool:
    return (
        load.free_blocks == load.total_blocks > 0
        and load.leases_held == 0
        and load.num_running == 0
        and load.num_waiting == 0
    )


async def assert_workers_free(prefill=(), decode=(), timeout: float = 10.0) -> None:
    """Every worker: no request, no lease, every KV block free (shortly after, not at once:
    releases and aborts reach the workers asynchronously)."""
    workers = [(a, "prefill") for a in prefill] + [(a, "decode") for a in decode]
    last: list = []

    async def all_free() -> bool:
        last[:] = [await worker_load(a, role) for a, role in workers]
        return all(_free(ld) for ld in last)

    try:
        await wait_until(all_free, timeout, "all KV blocks free")
    except AssertionError:
        held = [
            (a, str(ld).replace(chr(10), " ")) for (a, _), ld in zip(workers, last) if not _free(ld)
        ]
        raise AssertionError(f"KV still held: {held}") from None


def make_oracle(model):
    runner = ModelRunner(
        EngineConfig(
            model_path=str(model),
            device="cpu",
            cache={"num_blocks": 512, "block_size": BLOCK_SIZE},
            scheduler={"max_model_len": MAX_MODEL_LEN},
        )
    )
    engine = OfflineEngine(runner, Tokenizer.from_dir(model))
    cache: dict = {}

    def generate_offline(prompt: list[int], params: SamplingParams):
        key = (tuple(prompt), params)
        if key not in cache:
            [done] = engine.generate([list(prompt)], [params])
            assert engine.allocator.num_free == engine.allocator.num_usable
            cache[key] = done
        return cache[key]

    generate_offline.tokenizer = engine.tokenizer
    return generate_offline
