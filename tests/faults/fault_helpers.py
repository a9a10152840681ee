"""The fault suite's shared pieces: a ledger of terminal statuses (exactly once per request),
the uniform end-of-case check, worker start-up with a `faults` config, and /metrics reads.

Every case ends with `await finish_case(ledger, stub, oracle, prefill=[...], decode=[...])`:
  * every request the case sent has exactly one terminal status (client side), and the router
    (in-process, or a router process's metrics port) counted exactly as many outcomes (server
    side: none lost, none counted twice);
  * every worker's KV blocks are all free again, no lease held, nothing queued;
  * one more greedy request gives exactly the oracle's tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from helpers_procs import ProcessGroup, ServiceProcess, free_port
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import (
    assert_workers_free,
    greedy,
    ids_request,
    wait_until,
    worker_flags,
    worker_load,
)

from splitserve.protos import generate_pb2
from splitserve.request.sampling_params import SamplingParams

CLEAN_PROMPT = [1, 44, 45, 46, 200, 201, 202]
LONG = greedy(249, ignore_eos=True)  # up to max_model_len: long enough to act mid-stream
# test-only faults of the shared workers (conftest.py), each hitting request ids with a prefix
SLOW_PREFILL = "slowprefill"  # the step of the prompt's last chunk sleeps LAST_CHUNK_S
LAST_CHUNK_S = 2.0
REPLY_DELAY_S = 2.0  # ... and, the lease granted, its reply waits this long (slow on the wire)
CHUNK = 16  # the shared prefill worker's token budget per step: longer prompts take several chunks
SLOW_PULL = "slowpull"  # the decode worker waits PULL_DELAY_S, blocks reserved, before its KV pull
PULL_DELAY_S = 3.0


@dataclass
class FaultCluster:
    """One prefill and one decode worker process, each with a /metrics port."""

    model: Path
    procs: ProcessGroup
    prefill: str
    decode: str
    prefill_metrics: int
    decode_metrics: int


def start_worker(
    procs: ProcessGroup,
    role: str,
    model,
    faults: dict | None = None,
    *args: str,
    num_blocks: int = 128,
    wait: bool = True,
    kv_transfer: dict | None = None,
) -> tuple[ServiceProcess, int]:
    """A worker process (tiny model, block size 4) with the test-only `faults` config section
    (and `kv_transfer` settings) and a metrics port; (process, metrics port)."""
    flags = [*worker_flags(num_blocks), *args, "--metrics-port", str(port := free_port())]
    config = {"faults": faults} if faults else {}
    if role == "decode":  # the corrupted-payload cases run on one host, where it is off by default
        config["kv_transfer"] = {"checksum": "always"}
    if kv_transfer:
        config["kv_transfer"] = {**config.get("kv_transfer", {}), **kv_transfer}
    if config:
        path = procs.log_dir / f"{role}-faults-{len(procs.procs)}.yaml"
        path.write_text(yaml.safe_dump(config))
        flags += ["--config", str(path)]
    if role == "decode":
        flags += ["--max-batch-size", "8"]
    start = procs.prefill_worker if role == "prefill" else procs.decode_worker
    return start(model, *flags, wait=wait), port


def metric(port: int, name: str, **labels: str) -> float:
    """The sum of the samples called `name` with these labels, from a service's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@dataclass
class Tracked:
    """One Generate stream; `finish()` reads it to its end and records its terminal status."""

    ledger: Ledger
    request_id: str
    call: grpc.aio.UnaryStreamCall
    chunks: list[generate_pb2.GenerateResponse] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    details: str = ""

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    async def read(self, n: int = 1) -> None:
        for _ in range(n):
            msg = await self.call.read()
            assert msg is not grpc.aio.EOF, (
                f"{self.request_id} ended after {len(self.chunks)} chunks"
            )
            self.chunks.append(msg)

    async def finish(self) -> grpc.StatusCode:
        try:
            while (msg := await self.call.read()) is not grpc.aio.EOF:
                self.chunks.append(msg)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass  # the status tells
        self.code, self.details = await self.call.code(), await self.call.details()
        self.ledger.record(self.request_id, self.status)
        return self.code

    @property
    def status(self) -> str:
        """ "OK/<finish reason>" or the status code's name."""
        if self.code != grpc.StatusCode.OK:
            return self.code.name
        reason = self.chunks[-1].finish_reason if self.chunks else 0
        return f"OK/{generate_pb2.FinishReason.Name(reason).removeprefix('FINISH_REASON_')}"


class Ledger:
    """request id -> every terminal status seen; a second one for an id fails at once."""

    _ids = itertools.count()

    def __init__(self, name: str, router_baseline: float = 0.0) -> None:
        self.name = name
        self.sent: list[str] = []
        self.final: dict[str, str] = {}
        self.uncounted: set[str] = set()  # refused before the router's handler (undecodable bytes)
        self.router_baseline = router_baseline  # outcomes a long-lived router counted before

    def new_id(self) -> str:
        rid = f"{self.name}-{next(self._ids)}"
        self.sent.append(rid)
        return rid

    def start(
        self,
        stub,
        prompt,
        sampling=LONG,
        timeout: float | None = 60,
        request_id: str | None = None,
        **kw,
    ) -> Tracked:
        rid = request_id or self.new_id()
        if request_id:
            self.sent.append(rid)
        call = stub.Generate(ids_request(prompt, sampling, request_id=rid, **kw), timeout=timeout)
        return Tracked(self, rid, call)

    async def run(self, stub, prompt, sampling=LONG, timeout: float | None = 60, **kw) -> Tracked:
        tracked = self.start(stub, prompt, sampling, timeout, **kw)
        await tracked.finish()
        return tracked

    def record(self, request_id: str, status: str, counted: bool = True) -> None:
        assert request_id not in self.final, (
            f"{request_id} ended twice: {self.final[request_id]}, then {status}"
        )
        self.final[request_id] = status
        if not counted:
            self.uncounted.add(request_id)

    def statuses(self) -> Counter:
        return Counter(self.final.values())

    async def assert_exactly_once(self, router=None) -> None:
        """Client side: one terminal status per request sent. Server side, given the router (an
        in-process Router, or a router process's metrics port): it counted one outcome per
        request that reached its handler (all but `uncounted`), once the handlers ended."""
        missing = [r for r in self.sent if r not in self.final]
        assert not missing, f"no terminal status for {missing}"
        assert len(set(self.sent)) == len(self.sent), "a request id was sent twice"
        if router is None:
            return
        want = self.router_baseline + len(self.sent) - len(self.uncounted)
        await wait_until(lambda: router_outcomes(router) >= want, 5, "router outcomes")
        assert router_outcomes(router) == want, (router_outcomes(router), want, self.statuses())


def router_outcomes(router) -> float:
    """Generate calls a router counted by outcome, in total (Router object or metrics port)."""
    if isinstance(router, int):
        return metric(router, "splitserve_router_requests_total")
    return sum(
        s.value for s in router.metrics.requests.collect()[0].samples if s.name.endswith("_total")
    )


async def assert_clean(
    stub, oracle, prefill=(), decode=(), n: int = 1, timeout: float = 10.0
) -> None:
    """Every worker free, then `n` greedy requests give exactly the oracle's tokens."""
    await assert_workers_free(prefill, decode, timeout)
    want = oracle(CLEAN_PROMPT, SamplingParams(temperature=0, max_tokens=8)).token_ids
    for _ in range(n):
        chunks = [c async for c in stub.Generate(ids_request(CLEAN_PROMPT, greedy(8)), timeout=60)]
        assert [t for c in chunks for t in c.token_ids] == want
    await assert_workers_free(prefill, decode, timeout)


async def finish_case(
    ledger: Ledger, stub, oracle, prefill=(), decode=(), router=None, n: int = 1
) -> None:
    """The uniform end of every case (module docstring)."""
    await ledger.assert_exactly_once(router)
    await assert_clean(stub, oracle, prefill, decode, n)


async def start_on(
    ledger: Ledger, stub, target: str, others, prompt, sampling=LONG, tries: int = 4
) -> Tracked:
    """A long stream that runs on decode worker `target`: under round robin, a stream that lands
    on one of `others` is cancelled (recorded CANCELLED) and another one is started."""
    for _ in range(tries):
        t = ledger.start(stub, prompt, sampling)
        while True:
            loads = {a: (await worker_load(a, "decode")).num_running for a in (target, *others)}
            if any(loads.values()):
                break
            await asyncio.sleep(0.02)
        if loads[target]:
            return t
        t.call.cancel()
        await t.finish()
        await assert_workers_free([], others)
    raise AssertionError(f"no stream landed on {target} in {tries} tries")


async def leases_held(prefill: str) -> int:
    return (await worker_load(prefill, "prefill")).leases_held


async def wait_no_lease(prefill: str, timeout: float) -> None:
    async def none_held() -> bool:
        return await leases_held(prefill) == 0

    await wait_until(none_held, timeout, f"no lease held on {prefill}")


async def wait_all_healthy(router) -> None:
    await wait_until(
        lambda: all(w.healthy for w in router.registry.workers()), 10, "every worker healthy"
    )
