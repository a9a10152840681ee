"""Shared pieces of the prefill-worker tests: an in-process worker on a real grpc.aio
server (loopback, free port), its stub, and the end-of-test "no block leaked" check."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import grpc

from splitserve.kvtransfer.layer_stream_server import StreamEnd
from splitserve.prefill_worker.config import PrefillWorkerConfig
from splitserve.prefill_worker.engine import PrefillEngine
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc
from splitserve.service.grpc_service import channel_options

GREEDY = generate_pb2.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)


def worker_config(
    model,
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 8192,
    max_queue_len: int = 16,
    max_model_len: int | None = None,
    **extra: Any,
) -> PrefillWorkerConfig:
    return PrefillWorkerConfig.model_validate(
        {
            "engine": {
                "model_path": str(model),
                "device": "cpu",
                "cache": {"num_blocks": num_blocks, "block_size": block_size},
                "scheduler": {
                    "max_num_batched_tokens": budget,
                    "max_queue_len": max_queue_len,
                    "max_model_len": max_model_len,
                },
            },
            "server": {"host": "127.0.0.1", "port": 0, "drain_grace_s": 2.0},
            "warmup": False,
            **extra,
        }
    )


def assert_all_free(engine: PrefillEngine) -> None:
    """No request, no lease, no referenced block (evictable prefix-cache blocks count as free)."""
    engine.allocator.check_integrity()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert len(engine.leases) == 0
    assert engine.allocator.num_free == engine.allocator.num_usable
    assert all(engine.allocator.refcount(b) == 0 for b in range(1, engine.allocator.num_blocks))


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def serving(cfg: PrefillWorkerConfig, check_free: bool = True):
    """Yields (worker, stub); on a clean exit asserts that every block is free again."""
    worker = PrefillWorker(cfg)
    await worker.start()
    channel = grpc.aio.insecure_channel(worker.address, options=channel_options())
    try:
        yield worker, worker_pb2_grpc.PrefillWorkerStub(channel)
        if check_free:
            assert_all_free(worker.engine)
    finally:
        await channel.close()
        await worker.stop(grace_s=1.0)


def prefill_request(request_id: str, prompt, sampling=GREEDY, **kw) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling, **kw
    )


async def release(stub, resp: worker_pb2.PrefillResponse) -> None:
    got = await stub.ReleaseLease(
        worker_pb2.ReleaseLeaseRequest(lease_id=resp.kv.lease_id, request_id=resp.request_id)
    )
    assert got.released


async def drain_stream(feed) -> tuple[list, StreamEnd]:
    """A streamed hand-over's pieces up to its final message (StreamHub / FollowerStreamHub feed)."""
    pieces = []
    while not isinstance(item := await feed.next(10), StreamEnd):
        pieces.append(item)
    return pieces, item


def stream_coverage(pieces) -> set[tuple[int, int]]:
    """Every (layer, block) the pieces carry."""
    return {
        (layer, b)
        for p in pieces
        for layer in range(p.layer_start, p.layer_end)
        for b in range(p.block_start, p.block_end)
    }
