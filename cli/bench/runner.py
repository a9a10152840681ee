"""Sends the benchmark's requests to the router over grpc.aio and times each streamed chunk.

    info = await server_info(stub)                 GetServerInfo: vocab, max_model_len, workers
    results, duration = await run_requests(...)    arrivals, --max-concurrency, progress bar

Per request: TTFT at the first chunk carrying tokens, one ITL per later chunk carrying
tokens, E2E at the last chunk; the token counts come from the stream and its final Usage, the
router's timings of the request (where its TTFT went) from the last chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from splitserve.cli.bench.ttft_breakdown import timings_ms
from splitserve.cli.bench.workload import BenchConfig, BenchPrompt
from splitserve.cli.client import make_request, rpc_error_line
from splitserve.protos import generate_pb2, generate_pb2_grpc

RUN_ID = uuid.uuid4().hex[:8]  # request ids are unique across concurrent bench runs


class BenchError(RuntimeError):
    """The benchmark cannot run (router unreachable, prompts too long): one line."""


@dataclass
class RequestResult:
    index: int
    ok: bool = False
    error: str | None = None
    input_len: int = 0
    output_len: int = 0
    start_s: float = 0.0  # send time, from the benchmark's start
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    timings: dict[str, float] | None = None  # the router's per-request timings (ms; gRPC only)
    token_ids: list[int] | None = None  # the streamed tokens (gRPC; kept with --save-outputs)
    text: str | None = None  # the streamed text (OpenAI backend; kept with --save-outputs)
    kind: str = ""  # the request's traffic kind (traffic.py), "" for plain runs

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.output_len < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)


def sampling(cfg: BenchConfig, prompt: BenchPrompt) -> generate_pb2.SamplingParams:
    """The request's sampling: its own fields (dataset row, realistic traffic) or the run's."""
    fields = prompt.sampling if prompt.sampling is not None else {"temperature": cfg.temperature}
    if fields.get("top_k") == -1:  # vLLM's "off"; the wire field is unsigned (0 is off too)
        fields = {**fields, "top_k": 0}
    return generate_pb2.SamplingParams(
        max_tokens=prompt.output_len, ignore_eos=cfg.ignore_eos, **fields
    )


async def server_info(
    stub: generate_pb2_grpc.GenerateServiceStub, address: str
) -> generate_pb2.ServerInfo:
    try:
        return await stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=10.0)
    except grpc.aio.AioRpcError as err:
        raise BenchError(f"GetServerInfo on {address}: {rpc_error_line(err, address)}") from None


def check_lengths(prompts: list[BenchPrompt], max_model_len: int) -> None:
    for i, p in enumerate(prompts):
        n = p.known_input_len
        if n is not None and n + p.output_len > max_model_len:
            raise BenchError(
                f"prompt {i}: {n} input + {p.output_len} output tokens exceed the server's "
                f"max_model_len {max_model_len}; lower --input-len / --output-len"
            )


async def send_one(
    stub, cfg: BenchConfig, prompt: BenchPrompt, index: int, t0: float, tag: str = "bench"
) -> RequestResult:
    prompt_value = prompt.prompt if isinstance(prompt.prompt, str) else list(prompt.prompt)
    req = make_request(prompt_value, sampling(cfg, prompt), request_id=f"{tag}-{RUN_ID}-{index}")
    res = RequestResult(index, input_len=prompt.known_input_len or 0, kind=prompt.kind)
    res.token_ids = [] if cfg.save_outputs else None
    start = time.perf_counter()
    res.start_s = start - t0
    last = start
    try:
        async for chunk in stub.Generate(req, timeout=cfg.timeout_s):
            now = time.perf_counter()
            if chunk.token_ids:
                if res.ttft_s is None:
                    res.ttft_s = now - start
                else:
                    res.itls_s.append(now - last)
                last = now
                res.output_len += len(chunk.token_ids)
                if res.token_ids is not None:
                    res.token_ids.extend(chunk.token_ids)
            if chunk.finish_reason:
                res.input_len = chunk.usage.prompt_tokens or res.input_len
            if chunk.HasField("timings"):  # on the last chunk (ttft_breakdown.py)
                res.timings = timings_ms(chunk.timings)
        res.e2e_s = time.perf_counter() - start
        res.ok = res.ttft_s is not None
        res.error = None if res.ok else "stream ended without tokens"
    except grpc.aio.AioRpcError as err:
        res.e2e_s = time.perf_counter() - start
        res.error = rpc_error_line(err)
    return res


async def run_requests(
    stub,
    cfg: BenchConfig,
    prompts: list[BenchPrompt],
    offsets,
    on_done: Callable[[RequestResult], None] | None = None,
    send=None,
) -> tuple[list[RequestResult], float]:
    """All requests at their offsets (and under --max-concurrency); returns results in send
    order and the wall time from the first send to the last finish. `send` is `send_one` of a
    backend (this module's for gRPC, openai_runner's for HTTP), `stub` its client."""
    send = send or send_one
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int, prompt: BenchPrompt, at: float) -> RequestResult:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem if sem is not None else contextlib.nullcontext():
            res = await send(stub, cfg, prompt, i, t0)
        if on_done is not None:
            on_done(res)
        return res

    results = await asyncio.gather(
        *(one(i, p, float(at)) for i, (p, at) in enumerate(zip(prompts, offsets)))
    )
    return list(results), time.perf_counter() - t0


async def warm_up(stub, cfg: BenchConfig, prompts: list[BenchPrompt], send=None) -> None:
    """`num_warmups` requests (not measured); the first failure is a BenchError."""
    send = send or send_one
    for i in range(cfg.num_warmups):
        res = await send(stub, cfg, prompts[i % len(prompts)], i, time.perf_counter(), tag="warmup")
        if not res.ok:
            raise BenchError(f"warm-up request failed: {res.error}")
