"""One probe of one worker: what the registry's watch loop (registry.py) asks every poll_interval_s.

    grpc.health.v1 Check(role service)  ─┐ both within probe_timeout_s
    GetLoad (prefix keys for prefill)   ─┘ -> (ok, why not, eviction reason)
    prefill + verify_addresses: its advertised KV listener must accept a TCP connection

The answer's eviction reason is one of metrics.EVICTION_REASONS; whether it evicts at once or
only after probe_failures_to_evict timeouts in a row is the registry's call. A successful probe
stores the load on the Worker, with the prefix keys of the right length (any other is left out
and logged once per worker: a bad key must never fail a probe), and updates the per-worker
queue and free-block gauges.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2

from splitserve.protos import worker_pb2
from splitserve.request.block_hash import KEY_BYTES
from splitserve.router.config import RegistryConfig
from splitserve.router.metrics import RouterMetrics
from splitserve.router.reachability import kv_unreachable_message, tcp_unreachable
from splitserve.router.worker_state import PREFILL, ROLE_NAME, SERVICE, Worker

log = logging.getLogger(__name__)


async def probe_worker(
    w: Worker, rc: RegistryConfig, metrics: RouterMetrics, max_prefix_hashes: int
) -> tuple[bool, str, str]:
    """One health Check + GetLoad; (ok, why not, eviction reason: metrics.EVICTION_REASONS).
    `max_prefix_hashes` is asked of prefill workers only."""
    t = rc.probe_timeout_s
    n = max_prefix_hashes if w.role == PREFILL else 0
    try:
        health, load = await asyncio.gather(
            w.health.Check(health_pb2.HealthCheckRequest(service=SERVICE[w.role]), timeout=t),
            w.stub.GetLoad(worker_pb2.GetLoadRequest(max_prefix_hashes=n), timeout=t),
        )
    except grpc.aio.AioRpcError as err:
        code = err.code()
        reason = {
            grpc.StatusCode.DEADLINE_EXCEEDED: "probe_timeout",
            grpc.StatusCode.UNAVAILABLE: "refused",
        }.get(code, "probe_error")
        return False, f"probe failed: {code.name} ({err.details()})", reason
    except Exception as exc:  # noqa: BLE001 - a probe must never end the watch loop
        log.debug("probe of %s failed", w.address, exc_info=exc)
        return False, f"probe failed: {type(exc).__name__}: {exc}", "probe_error"
    if health.status != health_pb2.HealthCheckResponse.SERVING:
        return (
            False,
            f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}",
            "not_serving",
        )
    if load.role != w.role:
        return (
            False,
            (
                f"it answers as a {ROLE_NAME.get(load.role, 'unknown')} worker, not {w.role_name}; "
                "fix the router's worker lists"
            ),
            "wrong_role",
        )
    if (
        w.role == PREFILL
        and rc.verify_addresses
        and (why := await kv_unreachable(w, load, rc.probe_timeout_s))
    ):
        return False, why, "kv_unreachable"
    w.load = load
    w.prefix_keys = valid_prefix_keys(w, load.prefix_cache.block_keys)
    metrics.worker_queue.labels(w.role_name, w.address).set(load.num_running + load.num_waiting)
    metrics.worker_free_blocks.labels(w.role_name, w.address).set(load.free_blocks)
    return True, "", ""


def valid_prefix_keys(w: Worker, keys: Sequence[bytes]) -> frozenset[bytes]:
    """The keys of KEY_BYTES; any other (a worker of another version or a corrupt reply) is
    left out, and the first time for this worker logged. Fewer keys only cost cache hits."""
    good = frozenset(k for k in keys if len(k) == KEY_BYTES)
    bad = [len(k) for k in keys if len(k) != KEY_BYTES]
    if bad and not w.keys_warned:
        w.keys_warned = True
        log.warning(
            "%s worker %s sent %d prefix-cache keys not %d bytes long (e.g. %d bytes); "
            "ignoring them (logged once per worker)",
            w.role_name,
            w.address,
            len(bad),
            KEY_BYTES,
            bad[0],
        )
    return good


async def kv_unreachable(w: Worker, load: worker_pb2.WorkerLoad, timeout_s: float) -> str:
    """Why the prefill worker's advertised KV listener cannot be reached ('' when it can, or
    is not up yet); dialed until reached once, again only when the address changes."""
    kv = (load.kv_address.host, load.kv_address.port)
    if not kv[1] or kv == w.kv_verified:
        return ""
    why = await tcp_unreachable(*kv, timeout_s)
    if not why:
        w.kv_verified = kv
        return ""
    message = kv_unreachable_message(w.address, f"{kv[0]}:{kv[1]}", why)
    if w.kv_warned != kv:
        w.kv_warned = kv
        log.warning("%s worker %s kept out of rotation: %s", w.role_name, w.address, message)
    return message
