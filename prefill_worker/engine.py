"""The prefill engine: scheduler + prefix cache + leases around one ModelRunner.

    event-loop thread (owns every piece of state)        step thread (one, owns the model)
    ─────────────────────────────────────────────        ─────────────────────────────────
    prefill() / abort() / release_lease()   (gRPC handlers)
    _loop: expire leases, schedule ─── chunks, rows to sample ──▶ runner.prefill + sampler
           post-step: register full blocks,  ◀── first tokens ───┘
           grant leases, resolve futures

The step's pieces (its inputs, the step thread's work, the post-step bookkeeping) live in
prefill_step.py. Only the loop thread touches the allocator, so nothing is locked. A sequence
aborted while its chunk is in the step thread is only marked; the post-step pass frees it (one
step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from splitserve.engine.grammar_masks import grammar_lineages
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.sampler import SampleOutput, Sampler
from splitserve.prefill_worker.config import PrefillWorkerConfig
from splitserve.prefill_worker.leases import Lease, LeaseTable
from splitserve.prefill_worker.metrics import PrefillMetrics
from splitserve.prefill_worker.prefill_step import (
    constraint_failed,
    finish_prefill,
    register_full_blocks,
    run_step,
    step_inputs,
)
from splitserve.prefill_worker.prefix_cache import PrefixCache
from splitserve.prefill_worker.rehearsal import rehearsal_sizes, rehearse
from splitserve.prefill_worker.request import PrefillResult, PrefillSeq
from splitserve.prefill_worker.scheduler import PrefillScheduler, ScheduledChunk
from splitserve.prefill_worker.startup import release_graphs, warm_up
from splitserve.request.block_allocator import BlockAllocator
from splitserve.request.block_hash import block_keys
from splitserve.request.errors import RequestError
from splitserve.request.grammar_cache import GrammarCache
from splitserve.request.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class PrefillEngine:
    def __init__(
        self,
        cfg: PrefillWorkerConfig,
        runner: ModelRunner,
        metrics: PrefillMetrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.runner = runner
        self.metrics = metrics or PrefillMetrics()
        self.allocator = BlockAllocator(runner.num_blocks)
        self.cache = PrefixCache(self.allocator, runner.block_size, cfg.enable_prefix_cache)
        self.scheduler = PrefillScheduler(self.cache, cfg.engine.scheduler)
        self.leases = LeaseTable()
        self.eos = tuple(runner.model_config.eos_token_ids)
        self.sampler = Sampler(cfg.engine.seed, self.eos)
        self.grammars = GrammarCache(
            cfg.engine.model_path, self.vocab_size, self.eos, lineages=grammar_lineages()
        )
        self.grammars.on_compile = self.metrics.grammar_compile_seconds.observe
        self.fatal: BaseException | None = None
        self._on_fatal = on_fatal
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prefill-step")
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._in_step: set[PrefillSeq] = set()
        self.progress = 0  # steps finished (stall_watch.py)
        self.stream_hub = None  # kv_stream.StreamHub when streamed hand-overs are on
        self.rehearsal_sizes: list[int] = []  # the start-up rehearsal's prompt lengths

    @property
    def vocab_size(self) -> int:
        return self.runner.model_config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self, rehearse_now: bool = True) -> None:
        """Warm-up, the engine's loop, then (unless `rehearse_now` is False: the worker calls
        `rehearse` once its KV listener and stream hub are attached) the rehearsal."""
        loop = asyncio.get_running_loop()
        self.rehearsal_sizes = rehearsal_sizes(self)  # the pool is zeroed after it, if any
        if self.cfg.warmup:
            args = (self.cfg, self.runner, self.sampler, not self.rehearsal_sizes)
            await loop.run_in_executor(self._executor, warm_up, *args)
        self._task = asyncio.create_task(self._loop(), name="prefill-engine")
        if rehearse_now:
            await self.rehearse()
        self._update_gauges()

    async def rehearse(self) -> None:
        """The request path at every step size (rehearsal.py), then the KV pool zeroed."""
        if self.rehearsal_sizes:
            await rehearse(self, self.rehearsal_sizes)
            await asyncio.get_running_loop().run_in_executor(self._executor, self.runner.zero_kv)

    async def stop(self) -> None:
        """Ends the loop after its current step; queued requests get UNAVAILABLE; leases go.
        Idempotent."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        gone = RequestError.unavailable(
            "the prefill worker is shutting down; retry on another worker"
        )
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self._abort_seq(seq, gone, "unavailable")
        for lease in self.leases.pop_all():
            self.cache.free(lease.block_ids)
        self._executor.shutdown(wait=True)
        release_graphs(self.runner, self.sampler)
        self._update_gauges()

    # ---- requests (called on the loop thread) -----------------------------------------------
    async def prefill(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        lease_ttl_s: float,
        matcher: object | None = None,
        stream_token: str = "",
    ) -> PrefillResult:
        """Queues a validated request and waits for its first token (`matcher`: its compiled
        constraint, which masks that token)."""
        if self.fatal is not None or self._stopping or self._task is None:
            raise RequestError.unavailable(
                "the prefill worker is not serving; retry on another worker"
            )
        if self.scheduler.find(request_id) is not None:
            raise RequestError.invalid(
                f"request_id {request_id!r} is already in flight on this worker; "
                "give every request a unique id"
            )
        prompt = list(prompt)
        seq = PrefillSeq(
            request_id,
            prompt,
            params,
            lease_ttl_s,
            block_keys(prompt, self.runner.block_size) if self.cache.enabled else [],
            asyncio.get_running_loop().create_future(),
            matcher=matcher,
            stream_token=stream_token,
        )
        self.scheduler.add(seq)
        if self.stream_hub is not None:
            self.stream_hub.added(request_id)
        self._update_gauges()
        self._wake.set()
        try:
            return await seq.future
        except asyncio.CancelledError:  # the call was cancelled or its deadline passed
            fut = seq.future
            if not (fut.done() and not fut.cancelled() and fut.exception() is None):
                self._abort_seq(seq, None, "cancelled")
            elif fut.result().lease is not None:
                # finished just as the caller left: nobody will pull
                lease = self.leases.pop(fut.result().lease.lease_id)
                if lease is not None:
                    self._drop_lease(lease)
            raise

    def abort(self, request_id: str) -> bool:
        """Aborts a queued or running prefill and drops the leases of the request."""
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self._abort_seq(
                seq, RequestError.cancelled(f"request {request_id!r} was aborted"), "aborted"
            )
        leases = self.leases.pop_request(request_id)
        if leases and self.stream_hub is not None:
            self.stream_hub.aborted(request_id, "the request was aborted")
        for lease in leases:
            self._drop_lease(lease)
        return seq is not None or bool(leases)

    def release_lease(self, lease_id: str, request_id: str = "") -> bool:
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        if request_id and request_id != lease.request_id:
            shown = request_id if len(request_id) <= 80 else request_id[:80] + "..."
            raise RequestError.invalid(  # (never the whole id: gRPC caps a status's details)
                f"the lease belongs to request {lease.request_id!r}, not {shown!r}; "
                "pass the request_id of the same KvHandle"
            )
        self._drop_lease(self.leases.pop(lease_id))
        return True

    # ---- the loop ----------------------------------------------------------------------------
    async def _loop(self) -> None:
        try:
            while not self._stopping:
                await self._iteration()
        except Exception as exc:  # noqa: BLE001 - a failed model step or a broken invariant is fatal
            self._die(exc)

    async def _iteration(self) -> None:
        self._expire_leases()
        batch = self.scheduler.schedule()
        self._update_gauges()
        if not batch:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.leases.seconds_to_next_expiry())
            return
        chunks, rows, infos = step_inputs(batch)
        self._in_step = {c.seq for c in batch}
        delay = (
            self.cfg.faults.slow_last_chunk([batch[i].seq.request_id for i in rows])
            if rows
            else 0.0
        )
        start, loop = time.perf_counter(), asyncio.get_running_loop()
        hub = self.stream_hub
        if hub is not None:
            hub.before_step(batch)
        try:
            (sampled, sampling_s), thread_s = await loop.run_in_executor(
                self._executor,
                _timed,
                run_step,
                self.runner,
                self.sampler,
                chunks,
                rows,
                infos,
                delay,
            )
        finally:
            self._in_step = set()
            self.progress += 1
            if hub is not None:
                hub.after_step()
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        self.metrics.step_thread_seconds.observe(thread_s)
        self.metrics.batch_tokens.observe(sum(c.end - c.start for c in batch))
        if sampled is not None:  # the first tokens' sampling, for the metric and their replies
            self.metrics.sampling_seconds.observe(sampling_s)
            for c in batch:
                c.seq.sampling_time_s = sampling_s
        self._after_step(batch, sampled)

    def _after_step(self, batch: list[ScheduledChunk], sampled: SampleOutput | None) -> None:
        firsts = iter(zip(sampled.token_ids, sampled.logprobs)) if sampled else iter(())
        for c in batch:
            seq = c.seq
            first = next(firsts) if c.is_last else None
            if seq.aborted or seq.future.done():  # marked during the step
                self._abort_seq(seq, None, "cancelled")
                continue
            seq.num_computed = c.end
            register_full_blocks(self.cache, seq, self.runner.block_size)
            if first is not None:  # the prompt is done: a lease (or its blocks freed), the result
                self.scheduler.remove(seq)
                if constraint_failed(seq, self.grammars, self.cache, self.stream_hub):
                    self._freed()
                    continue
                finish_prefill(
                    seq, *first, self.eos, self.max_model_len, self.cache, self.leases, self.metrics
                )
                if self.stream_hub is not None:
                    self.stream_hub.finished(seq, seq.future.result())
        self._update_gauges()

    # ---- freeing -------------------------------------------------------------------------------
    def _abort_seq(self, seq: PrefillSeq, error: RequestError | None, outcome: str) -> None:
        if not seq.future.done() and error is not None:
            seq.future.set_exception(error)
        if not seq.aborted:
            seq.aborted = True
            self.metrics.requests.labels(outcome).inc()
            if self.stream_hub is not None:
                self.stream_hub.aborted(seq.request_id, f"the prefill ended: {outcome}")
        if seq in self._in_step:
            return  # the step thread still writes its blocks; _after_step frees them
        self.scheduler.remove(seq)
        if seq.block_table:
            self.cache.free(seq.block_table)
            seq.block_table = []
        self._freed()

    def _drop_lease(self, lease: Lease) -> None:
        if self.stream_hub is not None:  # a stream still sending must not read freed blocks
            self.stream_hub.lease_gone(lease.request_id)
        self.cache.free(lease.block_ids)
        self._freed()

    def _expire_leases(self) -> None:
        for lease in self.leases.pop_expired():
            log.warning(
                "lease %s of request %s expired after %.1fs uncollected; freeing %d blocks",
                lease.lease_id,
                lease.request_id,
                lease.ttl_s,
                len(lease.block_ids),
            )
            self.metrics.lease_expired.inc()
            self._drop_lease(lease)

    def _freed(self) -> None:
        self._update_gauges()
        self._wake.set()  # waiting requests may fit now

    def fail(self, exc: BaseException) -> None:
        """Fails the engine from outside a step (a tensor-parallel rank died: the step in flight
        may never return); the step's own failure afterwards changes nothing."""
        self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """A failed step: the engine stops; every request it holds gets UNAVAILABLE. Once."""
        if self.fatal is not None:
            return
        log.error("prefill engine failed, worker stops serving: %s: %s", type(exc).__name__, exc)
        log.debug("prefill engine failure", exc_info=exc)
        self.fatal = exc
        if self._on_fatal is not None:  # health first, so no caller learns of the failure before it
            self._on_fatal(exc)
        err = RequestError.unavailable(
            f"the prefill worker failed ({type(exc).__name__}: {exc}); retry on another worker"
        )
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self._abort_seq(seq, err, "failed")
        for lease in self.leases.pop_all():
            self.cache.free(lease.block_ids)
        self._update_gauges()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_length.set(len(self.scheduler.waiting))
        m.running.set(len(self.scheduler.running))
        m.leases_held.set(len(self.leases))
        m.blocks_free.set(self.allocator.num_free)
        m.blocks_used.set(self.allocator.num_usable - self.allocator.num_free)
        m.cached_blocks.set(self.cache.num_cached_blocks)


def _timed(fn, *args):
    """(fn(*args), its wall seconds on the calling thread: the step thread)."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0
