"""Shared pieces of the OpenAI API tests: worker flags, the running stack (addresses, plain HTTP
and gRPC calls, the "every worker's KV is free" check), an in-process router without workers
and the single-process oracle."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from helpers_procs import ProcessGroup

from splitserve.protos import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 4
MAX_MODEL_LEN = 256
MODEL = "tiny"  # the router's --model-name


def worker_flags(num_blocks: int = 128) -> list[str]:
    return [
        "--num-blocks",
        str(num_blocks),
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]


def http(
    method: str, url: str, body: Any = None, timeout: float = 30.0
) -> tuple[int, Any, dict[str, str]]:
    """(status, parsed JSON or text, headers) of one plain HTTP call."""
    data = (
        None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    )
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw, headers = resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        status, raw, headers = err.code, err.read(), dict(err.headers)
    text = raw.decode()
    try:
        return status, json.loads(text), headers
    except ValueError:
        return status, text, headers


def worker_load(address: str, role: str) -> worker_pb2.WorkerLoad:
    stub_cls = (
        worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    )
    with grpc.insecure_channel(address) as ch:
        return stub_cls(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def _free(load: worker_pb2.WorkerLoad) -> bool:
    return (
        load.free_blocks == load.total_blocks > 0
        and load.leases_held == 0
        and load.num_running == 0
        and load.num_waiting == 0
    )


def _metric_value(page: str, line_prefix: str) -> float:
    """The value of the first line of a /metrics page starting with `line_prefix` (0 when absent)."""
    for line in page.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@dataclass
class Stack:
    model: Path
    prefill: str
    decode: str
    grpc_address: str
    base_url: str  # http://127.0.0.1:PORT
    procs: ProcessGroup
    decode_metrics_port: int | None = None

    def decode_finished(self, reason: str) -> float:
        """Requests the decode worker ended for `reason` ("abort": a cancel reached it; "error"),
        from its /metrics."""
        page = http("GET", f"http://127.0.0.1:{self.decode_metrics_port}/metrics")[1]
        return _metric_value(
            page, f'splitserve_decode_requests_finished_total{{reason="{reason}"}}'
        )

    def get(self, path: str) -> tuple[int, Any, dict[str, str]]:
        return http("GET", self.base_url + path)

    def post(self, path: str, body: Any) -> tuple[int, Any, dict[str, str]]:
        return http("POST", self.base_url + path, body)

    def wait_http_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"GET /health not 200 within {timeout}s")
            time.sleep(0.1)

    def assert_free(self, timeout: float = 10.0) -> None:
        """Every worker: no request, no lease, every KV block free (releases arrive asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            loads = [
                (a, worker_load(a, role))
                for a, role in ((self.prefill, "prefill"), (self.decode, "decode"))
            ]
            if all(_free(ld) for _, ld in loads):
                return
            if time.monotonic() > deadline:
                held = [(a, str(ld).replace("\n", " ")) for a, ld in loads if not _free(ld)]
                raise AssertionError(f"KV still held: {held}")
            time.sleep(0.05)

    def grpc_generate(self, prompt: str | list[int], sampling: generate_pb2.SamplingParams) -> list:
        """The chunks of one gRPC Generate call on the same router."""
        req = generate_pb2.GenerateRequest(sampling=sampling)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        with grpc.insecure_channel(self.grpc_address) as ch:
            return list(generate_pb2_grpc.GenerateServiceStub(ch).Generate(req, timeout=60))

    def metric(self, line_prefix: str) -> float:
        """The value of the first /metrics line starting with `line_prefix` (0 when absent)."""
        return _metric_value(self.get("/metrics")[1], line_prefix)


def still_serving(client) -> None:
    """A short greedy completion through the openai `client` still gets its two tokens."""
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2


def chat_until_stop(client, messages, seed: int, max_tokens: int, **kw) -> str:
    """A chat completion sampled at temperature 1 with `seed` (plus `kw`) through the openai
    client, which must end with finish_reason "stop"; its text."""
    out = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        **kw,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", (kw, choice)
    return choice.message.content


@contextlib.asynccontextmanager
async def router_without_workers(model: Path):
    """An in-process router for the checkpoint in `model` (gRPC and HTTP on free loopback ports),
    with no worker to send requests to; stopped on exit."""
    from splitserve.router.config import RouterConfig
    from splitserve.router.server import Router

    cfg = RouterConfig.model_validate(
        {
            "model_path": str(model),
            "server": {"host": "127.0.0.1", "port": 0},
            "http": {"port": 0},
            "registry": {"poll_interval_s": 0.2},
        }
    )
    router = Router(cfg)
    await router.start()
    try:
        yield router
    finally:
        await router.stop(1.0)


def make_oracle(model):
    """(prompt ids, SamplingParams) -> the OfflineEngine Completion (tokens, text, finish reason)."""
    from splitserve.config.engine_config import EngineConfig
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.offline import OfflineEngine
    from splitserve.request.tokenizer import Tokenizer

    runner = ModelRunner(
        EngineConfig(
            model_path=str(model),
            device="cpu",
            cache={"num_blocks": 512, "block_size": BLOCK_SIZE},
            scheduler={"max_model_len": MAX_MODEL_LEN},
        )
    )
    engine = OfflineEngine(runner, Tokenizer.from_dir(model))

    def generate_offline(prompt: list[int], params):
        [done] = engine.generate([list(prompt)], [params])
        assert engine.allocator.num_free == engine.allocator.num_usable
        return done

    generate_offline.tokenizer = engine.tokenizer
    return generate_offline
