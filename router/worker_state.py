"""One worker as the router knows it: its channel and stubs, health, last load, requests in flight.

Apart from registry.py so that the probe (probing.py), the request path (generation.py,
decode_stream.py) and the HTTP front can name a Worker and the role constants without the
registry's membership and eviction logic.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2_grpc

from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc
from splitserve.router.policies import WorkerView

PREFILL = generate_pb2.WORKER_ROLE_PREFILL
DECODE = generate_pb2.WORKER_ROLE_DECODE
ROLE_NAME = {PREFILL: "prefill", DECODE: "decode"}
SERVICE = {PREFILL: "splitserve.v1.PrefillWorker", DECODE: "splitserve.v1.DecodeWorker"}
STUB = {PREFILL: worker_pb2_grpc.PrefillWorkerStub, DECODE: worker_pb2_grpc.DecodeWorkerStub}


@dataclass(eq=False)
class Worker:
    role: int
    address: str
    static: bool
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    probe_ok: bool = False
    why: str = "not probed yet"  # why it is unhealthy
    slow_probes: int = 0  # timed-out probes in a row
    load: worker_pb2.WorkerLoad = field(default_factory=worker_pb2.WorkerLoad)
    prefix_keys: frozenset[bytes] = frozenset()  # valid ones only (probing.py)
    keys_warned: bool = False  # a malformed prefix key was logged (once per worker)
    in_flight: int = 0
    last_heartbeat: float = 0.0
    task: asyncio.Task | None = None
    kv_verified: tuple[str, int] | None = None  # the advertised KV listener the router reached
    kv_warned: tuple[str, int] | None = None  # ... or last failed to reach (logged once)

    @property
    def role_name(self) -> str:
        return ROLE_NAME[self.role]

    def view(self) -> WorkerView:
        ld = self.load
        return WorkerView(
            self.address,
            ld.num_running,
            ld.num_waiting,
            ld.free_blocks,
            ld.total_blocks,
            ld.block_size,
            self.prefix_keys,
            self.in_flight,
        )
