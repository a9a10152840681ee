"""No stuck-but-healthy worker: a prefill and a decode worker whose engine is blocked (the test-only
step delays) answer NOT_SERVING while the request waits, and SERVING again once the step ends;
the request still completes and every block is free. The health answers come while the engine
thread sleeps: they never wait on it. StallWatch's own rules (idle time is no stall, a failed
engine never comes back) are checked with a fake clock."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import helpers_procs
from fault_helpers import start_worker
from grpc_health.v1 import health_pb2

from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc
from splitserve.worker.stall_watch import StallWatch

SERVING, NOT_SERVING = (
    health_pb2.HealthCheckResponse.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING,
)
BLOCKED_S = 8.0  # the stuck step; far longer than the stall timeout below
STALL_S = 1.0
PROMPT = [1, 44, 45, 46, 200, 201, 202]


class HealthLog:
    """Polls a worker's health in a thread; the statuses in the order seen (repeats dropped)."""

    def __init__(self, sp) -> None:
        self.sp, self.seen, self._stop = sp, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            status = helpers_procs.health_status(self.sp.address, self.sp.service, timeout=2.0)
            if status is not None and (not self.seen or self.seen[-1] != status):
                self.seen.append(status)

    def wait_for(self, status: int, timeout: float = 60.0) -> None:
        """Until the latest status seen is `status`."""
        deadline = time.monotonic() + timeout
        while not self.seen or self.seen[-1] != status:
            assert time.monotonic() < deadline, (
                f"{self.sp.name} never answered {status}: saw {self.seen}"
            )
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def test_prefill_engine_blocked_goes_not_serving_and_back(tiny_llama, procs):
    sp, _ = start_worker(
        procs,
        "prefill",
        tiny_llama,
        {"last_chunk_delay_s": BLOCKED_S, "request_id_prefix": "stuck"},
        "--stall-timeout-s",
        str(STALL_S),
    )
    stub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(sp.address))
    health = HealthLog(sp)
    try:
        health.wait_for(SERVING)
        call = stub.Prefill.future(
            worker_pb2.PrefillRequest(request_id="stuck-0", prompt_token_ids=PROMPT), timeout=90
        )
        health.wait_for(NOT_SERVING)
        assert not call.done(), "NOT_SERVING must come while the step is still blocked"
        resp = call.result()
        health.wait_for(SERVING)
        health.close()
        assert health.seen[-2:] == [NOT_SERVING, SERVING], health.seen
        stub.ReleaseLease(
            worker_pb2.ReleaseLeaseRequest(lease_id=resp.kv.lease_id, request_id="stuck-0"),
            timeout=10,
        )
        helpers_procs.all_free(stub)
        assert "made no progress" in sp.log() and "making progress again" in sp.log()
    finally:
        health.close()


def test_decode_engine_blocked_goes_not_serving_and_back(tiny_llama, procs):
    sp, _ = start_worker(
        procs,
        "decode",
        tiny_llama,
        {"step_delay_s": BLOCKED_S, "request_id_prefix": "stuck"},
        "--stall-timeout-s",
        str(STALL_S),
    )
    stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(sp.address))
    health = HealthLog(sp)
    try:
        health.wait_for(SERVING)
        time.sleep(
            3 * STALL_S
        )  # idle for longer than the stall timeout: no false stall at the next request
        assert health.seen == [SERVING], health.seen
        req = worker_pb2.DecodeRequest(
            request_id="stuck-0",
            prompt_token_ids=PROMPT,
            sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        )
        stream = stub.Decode(req, timeout=90)
        health.wait_for(NOT_SERVING)
        tokens = [t for chunk in stream for t in chunk.token_ids]
        health.wait_for(SERVING)
        health.close()
        assert len(tokens) == 1 and health.seen[-2:] == [NOT_SERVING, SERVING], (
            tokens,
            health.seen,
        )
        helpers_procs.all_free(stub)
    finally:
        health.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_stall_watch_rules():
    async def body():
        clock, state, calls = _Clock(), {"busy": False, "progress": 0, "failed": False}, []

        async def set_serving(serving: bool) -> None:
            calls.append(serving)

        watch = StallWatch(
            "test",
            lambda: state["busy"],
            lambda: state["progress"],
            lambda: state["failed"],
            60.0,
            set_serving,
            clock=clock,
        )
        watch.tick_s = 0.01

        async def ticks(n: int = 5) -> None:
            await asyncio.sleep(watch.tick_s * n)

        watch.start()
        clock.now += 3600  # idle for an hour
        await ticks()
        state["busy"] = True  # a request arrives: the clock starts now, not at the last step
        await ticks()
        assert calls == [] and not watch.stalled
        clock.now += 59
        await ticks()
        assert calls == []
        clock.now += 2  # 61 s busy without progress
        await ticks()
        assert calls == [False] and watch.stalled and watch.stalls == 1
        state["progress"] += 1
        await ticks()
        assert calls == [False, True] and not watch.stalled
        state["failed"] = True
        await ticks()
        assert calls == [False, True, False]
        assert watch._task.done()  # a failed engine never comes back
        await watch.stop()

    asyncio.run(body())
