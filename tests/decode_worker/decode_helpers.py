"""Helpers for the decode-worker tests: an engine on the tiny model, the isolated-generation
oracle (OfflineEngine, one request at a time), and a driver that feeds requests in at chosen
steps and collects what each stream received."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.config.engine_config import EngineConfig
from splitserve.decode_worker.config import DecodeWorkerConfig
from splitserve.decode_worker.engine import DecodeEngine
from splitserve.decode_worker.sequence import DecodeInput, StepOutput
from splitserve.engine.model_runner import PrefillChunk
from splitserve.request.tokenizer import Tokenizer

MAX_MODEL_LEN = 256


def engine_config(
    model, *, num_blocks=128, block_size=4, max_batch_size=8, **kw
) -> DecodeWorkerConfig:
    eng = EngineConfig(
        model_path=str(model),
        cache={"num_blocks": num_blocks, "block_size": block_size},
        scheduler={"max_batch_size": max_batch_size, "max_model_len": MAX_MODEL_LEN},
    )
    return DecodeWorkerConfig(engine=eng, **kw)


def make_engine(model, **kw) -> DecodeEngine:
    cfg = engine_config(model, **kw)
    return DecodeEngine(cfg, tokenizer=Tokenizer.from_dir(model))


@dataclass
class Collected:
    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    logprobs: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    final: dict[str, StepOutput] = field(default_factory=dict)

    def sink(self, rid: str) -> Callable[[StepOutput], None]:
        def put(out: StepOutput) -> None:
            assert rid not in self.final, f"{rid}: output after the final chunk"
            self.tokens[rid].extend(out.token_ids)
            self.logprobs[rid].extend(out.logprobs)
            if out.finished:
                self.final[rid] = out

        return put


def prefill_into_engine(engine: DecodeEngine, prompt: list[int]) -> list[int]:
    """Stands in for the KV pull: the decode worker's own blocks get the prompt's KV."""
    n = -(-len(prompt) // engine.runner.block_size)
    got = engine.allocator.allocate(n)
    assert got is not None
    engine.runner.prefill([PrefillChunk(prompt, 0, list(got.block_ids))])
    return list(got.block_ids)


def submit(
    engine: DecodeEngine, col: Collected, rid: str, prompt, first: int, params, with_kv: bool
) -> None:
    inp = DecodeInput(rid, list(prompt), first, params)
    if with_kv:
        engine.admit(inp, prefill_into_engine(engine, list(prompt)), col.sink(rid))
    else:
        engine.submit(inp, col.sink(rid))


def drive(
    engine: DecodeEngine, arrivals: dict[int, list[Callable[[], None]]], max_steps: int = 2000
) -> int:
    """Runs steps, calling arrivals[step] before that step; returns the steps taken."""
    last = max(arrivals, default=0)
    for step in range(max_steps):
        for fn in arrivals.get(step, ()):
            fn()
        if step > last and not engine.has_work:
            return step
        if engine.has_work:
            engine.step()
    raise AssertionError("engine did not finish")


def assert_all_free(engine: DecodeEngine) -> None:
    engine.allocator.check_integrity()
    assert engine.allocator.num_free == engine.allocator.num_usable
    assert (
        not engine.scheduler.running and not engine.scheduler.waiting and not engine.scheduler.by_id
    )


def worker_config(model, **kw) -> DecodeWorkerConfig:
    base = engine_config(model, **kw)
    return base.model_copy(update={"server": base.server.model_copy(update={"drain_grace_s": 2.0})})


def decode_request(rid: str, prompt, first: int, **sampling):
    from splitserve.protos import generate_pb2, worker_pb2

    return worker_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=list(prompt),
        first_token_id=first,
        sampling=generate_pb2.SamplingParams(**sampling),
    )


async def collect_stream(call) -> tuple[list[int], list]:
    """All token ids of a Decode stream, and its chunks."""
    tokens, chunks = [], []
    async for chunk in call:
        tokens.extend(chunk.token_ids)
        chunks.append(chunk)
    return tokens, chunks


@contextlib.asynccontextmanager
async def serving(model, **kw):
    """A DecodeWorker on a free loopback port, and a stub to it: (worker, stub, channel)."""
    import grpc

    from splitserve.decode_worker.worker import DecodeWorker
    from splitserve.protos import worker_pb2_grpc
    from splitserve.service.grpc_service import channel_options

    worker = DecodeWorker(worker_config(model, **kw))
    await worker.start()
    channel = grpc.aio.insecure_channel(worker.address, options=channel_options())
    try:
        yield worker, worker_pb2_grpc.DecodeWorkerStub(channel), channel
    finally:
        await channel.close()
        await worker.stop(grace_s=1.0)
