"""What `benchmarks/soak.py` watches on the services: each worker's health as the router sees it
(kill detection and recovery), KV blocks, leases and running requests left on the workers at
the end (leaks; orphaned leases are waited out), and a process's resident memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import grpc

from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc
from splitserve.service.tls import open_channel

# a killed router leaves the leases of its in-flight requests to expire on the prefill workers
# (nothing else can release them): short, so the end-of-run check can wait them out
LEASE_TTL_S = 5.0


async def worker_health(stub) -> dict[str, bool]:
    info = await stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)
    return {w.address: w.healthy for w in info.workers}


class SoakFailure(RuntimeError):
    """The soak could not go on (a restarted process never came back, ...): one line."""


async def wait_health(stub, child, healthy: bool, timeout: float = 120.0) -> float:
    start = time.monotonic()
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):  # the router itself may be restarting
            if (await worker_health(stub)).get(child.address) == healthy:
                return time.monotonic() - start
        if healthy and not child.alive():
            raise SoakFailure(f"{child.name} exited with {child.proc.returncode} after its restart")
        if time.monotonic() - start > timeout:
            raise SoakFailure(
                f"{child.address} ({child.name}) not {'healthy' if healthy else 'evicted'} in the "
                f"router within {timeout:.0f}s"
            )
        await asyncio.sleep(0.02)


async def leaks(children) -> dict[str, dict]:
    out = {}
    for c in children:
        stub_cls = (
            worker_pb2_grpc.PrefillWorkerStub
            if c.subcommand == "prefill-worker"
            else worker_pb2_grpc.DecodeWorkerStub
        )
        async with open_channel(c.address, c.tls) as ch:
            for _ in range(
                int((LEASE_TTL_S + 10) * 10)
            ):  # releases are asynchronous, orphaned leases expire
                ld = await stub_cls(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
                if ld.free_blocks == ld.total_blocks and not (
                    ld.leases_held or ld.num_running or ld.num_waiting
                ):
                    break
                await asyncio.sleep(0.1)
        out[c.name] = {
            "leaked_blocks": ld.total_blocks - ld.free_blocks,
            "leases": ld.leases_held,
            "running": ld.num_running + ld.num_waiting,
        }
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
