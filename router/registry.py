"""The router's view of its workers: who exists, who is healthy, how loaded each one is.

    static workers (config)  ─┐                      every poll_interval_s, per worker:
    RegisterWorker (dynamic) ─┴─▶ Worker ──probe──▶   grpc.health.v1 Check(role service)
                                    │                 GetLoad (prefix hashes for prefill)
                                    ▼
           healthy = last probe ok  and  (static  or  heartbeat within heartbeat_timeout_s)

An unhealthy worker is evicted: no new requests go there (in-flight ones finish or fail on
their own); it returns as soon as it is healthy again. A probe that only timed out (a busy
worker, a slow machine) evicts after `probe_failures_to_evict` in a row; anything that says the
worker is gone or unwilling evicts at once: a refused connection or a broken transport
(UNAVAILABLE: keepalive finds a vanished host), NOT_SERVING (drain, stalled engine), a wrong
role, an unreachable KV listener, heartbeat silence, a request that saw UNAVAILABLE. A registered worker silent for
forget_after_s is removed; static workers stay listed (healthy=false) and keep being
probed. A request that sees UNAVAILABLE from a worker reports it (`report_failure`), which
evicts the worker at once instead of at the next probe. A RegisterWorker whose address the
router cannot dial is refused (register_checked); a prefill worker whose advertised KV
listener it cannot reach stays out of rotation (registry.verify_addresses, reachability.py).

This module holds membership, choosing and the watch loop that turns probes into health; one
probe is probing.py, the Worker record and the role constants are worker_state.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2_grpc

from splitserve.request.errors import RequestError
from splitserve.router.config import RouterConfig, check_address
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policies import Policy
from splitserve.router.probing import probe_worker
from splitserve.router.reachability import check_reachable
from splitserve.router.worker_state import DECODE, PREFILL, ROLE_NAME, SERVICE, STUB, Worker
from splitserve.service.cluster_auth import client_interceptors
from splitserve.service.credentials import cluster_secret
from splitserve.service.grpc_service import channel_options
from splitserve.service.tls import client_credentials, open_channel

log = logging.getLogger(__name__)


class WorkerRegistry:
    def __init__(
        self,
        cfg: RouterConfig,
        metrics: RouterMetrics,
        on_change: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.rc = cfg.registry
        self.metrics = metrics
        self._on_change = on_change
        self._clock = clock
        self._workers: dict[str, Worker] = {}
        # workers started with the cluster secret take calls only with it (service/cluster_auth.py)
        self._secret = cluster_secret(cfg.auth.cluster_secret_file)
        self._closed = False
        self._prefix_hashes = (
            self.rc.max_prefix_hashes if cfg.routing.prefill_policy == "prefix_aware" else 0
        )

    # ---- membership --------------------------------------------------------------------------
    def start(self) -> None:
        if self.cfg.workers_tls is not None:  # a bad file: one line at start, not per worker
            client_credentials(self.cfg.workers_tls, "workers_tls")
        for address in self.cfg.workers.prefill:
            self._add(PREFILL, address, static=True)
        for address in self.cfg.workers.decode:
            self._add(DECODE, address, static=True)

    async def close(self) -> None:
        """Stops every probe and closes the channels; idempotent."""
        self._closed = True
        workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            await self._drop(w)

    def _channel(self, address: str) -> grpc.aio.Channel:
        """To a worker: TLS per workers_tls (mutual with its cert_file), else plaintext."""
        return open_channel(
            address,
            self.cfg.workers_tls,
            channel_options(self.cfg.server),
            interceptors=client_interceptors(self._secret),
        )

    def _add(self, role: int, address: str, static: bool) -> Worker:
        channel = self._channel(address)
        w = Worker(
            role,
            address,
            static,
            channel,
            STUB[role](channel),
            health_pb2_grpc.HealthStub(channel),
            last_heartbeat=self._clock(),
        )
        self._workers[address] = w
        self.metrics.worker_healthy.labels(w.role_name, address).set(0)
        w.task = asyncio.get_running_loop().create_task(self._watch(w), name=f"probe {address}")
        log.info(
            "%s worker %s added (%s)", w.role_name, address, "static" if static else "registered"
        )
        return w

    async def _drop(self, w: Worker) -> None:
        if w.task is not None and w.task is not asyncio.current_task():
            w.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await w.task
        await w.channel.close()
        self.metrics.forget_worker(w.role_name, w.address)

    async def register_checked(self, role: int, address: str) -> Worker:
        """register(), but a new address is dialed first (reachability.py): one the router cannot
        reach is FAILED_PRECONDITION naming --advertise-host, not a worker that never gets healthy."""
        self._validate(role, address)
        if self.rc.verify_addresses and address not in self._workers:
            async with self._channel(address) as channel:
                await check_reachable(
                    channel,
                    ROLE_NAME[role],
                    SERVICE[role],
                    address,
                    self.rc.probe_timeout_s,
                    check_kv=role == PREFILL,
                )
        return self.register(role, address)

    def register(self, role: int, address: str) -> Worker:
        self._validate(role, address)
        w = self._workers.get(address)
        if w is None:
            return self._add(role, address, static=False)
        w.last_heartbeat = self._clock()
        return w

    def _validate(self, role: int, address: str) -> None:
        if role not in ROLE_NAME:
            what = "unset" if role == 0 else f"{role}, which is no worker role"
            raise RequestError.invalid(
                f"role is {what}; register as WORKER_ROLE_PREFILL or WORKER_ROLE_DECODE"
            )
        try:
            check_address(address)
        except ValueError as exc:
            raise RequestError.invalid(
                f"address: {exc}; give the address the router should dial"
            ) from None
        if role == PREFILL and self.cfg.routing.colocated:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this router runs colocated (routing.colocated) and sends no prefills; register "
                "decode workers only, or restart the router without --colocated",
            )
        w = self._workers.get(address)
        if w is not None and w.role != role:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{address} is already registered as a {w.role_name} worker; one role per "
                "address (restart the router to change it, or use another port)",
            )

    def heartbeat(self, role: int, address: str) -> bool:
        w = self._workers.get(address)
        if w is None or w.role != role:
            return False
        w.last_heartbeat = self._clock()
        return True

    def workers(self) -> list[Worker]:
        return sorted(self._workers.values(), key=lambda w: (w.role, w.address))

    def get(self, address: str) -> Worker | None:
        return self._workers.get(address)

    def healthy(self, role: int) -> list[Worker]:
        return [w for w in self._workers.values() if w.role == role and w.healthy]

    # ---- choosing ------------------------------------------------------------------------------
    def choose(
        self,
        role: int,
        policy: Policy,
        prompt: Sequence[int],
        exclude: Sequence[str] = (),
        compat_hash: str = "",
    ) -> Worker:
        """A healthy worker of `role` (not in `exclude`; serving the same model when
        `compat_hash` is given) picked by `policy`; UNAVAILABLE when there is none."""
        name = ROLE_NAME[role]
        pool = [w for w in self.healthy(role) if w.address not in exclude]
        if not pool:
            known = [w for w in self._workers.values() if w.role == role]
            why = (
                "; ".join(f"{w.address}: {w.why}" for w in known if not w.healthy)
                or f"no {name} worker is known"
            )
            raise RequestError.unavailable(
                f"no healthy {name} worker{' besides ' + ', '.join(exclude) if exclude else ''} ({why}); "
                f"start one, list it with --{name}, or let it RegisterWorker, then retry"
            )
        if compat_hash:
            same = [
                w
                for w in pool
                if not w.load.model_compat_hash or w.load.model_compat_hash == compat_hash
            ]
            if not same:
                raise RequestError.unavailable(
                    f"no healthy {name} worker serves the model of the prefill worker (compat hash {compat_hash}); "
                    "run prefill and decode workers on the same checkpoint, dtype and block size"
                )
            pool = same
        by_address = {w.address: w for w in pool}
        return by_address[policy.choose([w.view() for w in pool], prompt).address]

    def report_failure(self, w: Worker, why: str) -> None:
        """A request saw the worker UNAVAILABLE: evict it until a probe succeeds again."""
        w.probe_ok = False
        self._set_healthy(w, False, why, "request_unavailable")

    # ---- probing -------------------------------------------------------------------------------
    async def _watch(self, w: Worker) -> None:
        while not self._closed:
            ok, why, reason = await self.probe(w)
            w.probe_ok = ok
            w.slow_probes = w.slow_probes + 1 if reason == "probe_timeout" else 0
            if not w.static:
                silent = self._clock() - w.last_heartbeat
                if silent > self.rc.forget_after_s:
                    log.warning(
                        "%s worker %s silent for %.0fs: removed", w.role_name, w.address, silent
                    )
                    self.metrics.worker_evictions.labels(w.role_name, "removed").inc()
                    self._set_healthy(w, False, "removed", "removed", count=False)
                    if self._workers.get(w.address) is w:
                        del self._workers[w.address]
                    await self._drop(w)
                    return
                if ok and silent > self.rc.heartbeat_timeout_s:
                    ok, why, reason = False, f"no heartbeat for {silent:.1f}s", "heartbeat_silence"
            if (
                reason == "probe_timeout"
                and w.healthy
                and w.slow_probes < self.rc.probe_failures_to_evict
            ):
                log.info(
                    "%s worker %s: slow probe %d of %d before eviction (%s)",
                    w.role_name,
                    w.address,
                    w.slow_probes,
                    self.rc.probe_failures_to_evict,
                    why,
                )
            else:
                self._set_healthy(w, ok, why, reason)
            await asyncio.sleep(self.rc.poll_interval_s)

    async def probe(self, w: Worker) -> tuple[bool, str, str]:
        """One health Check + GetLoad (probing.py); (ok, why not, eviction reason)."""
        return await probe_worker(w, self.rc, self.metrics, self._prefix_hashes)

    def _set_healthy(
        self, w: Worker, healthy: bool, why: str, reason: str = "", count: bool = True
    ) -> None:
        w.why = "" if healthy else why
        if healthy == w.healthy:
            return
        w.healthy = healthy
        if why != "removed":
            self.metrics.worker_healthy.labels(w.role_name, w.address).set(int(healthy))
        if healthy:
            log.info("%s worker %s is healthy: receiving requests", w.role_name, w.address)
        else:
            if count:
                self.metrics.worker_evictions.labels(w.role_name, reason or "probe_error").inc()
            log.warning("%s worker %s evicted: %s", w.role_name, w.address, why)
        if self._on_change is not None:
            self._on_change()
