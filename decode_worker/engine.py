"""The decode engine: scheduler + graph runner + sampler + stop checks, one `step()` at a time.

Stop checks here are eos, stop token ids and length; stop strings are text work, matched by the
servicer on the event loop (stop_strings.py), never on this thread.

Single-threaded (the engine loop thread, or a test, calls it). One step:

    1. (overlap off only) the still-unread step is finished first
    2. schedule: grow / preempt / admit; recompute (local prefill, recompute.py) the KV of
       admitted sequences that have none (preempted ones, and requests whose KvHandle is empty),
       at most prefill_chunk_tokens of it a step (chunked prefill: a long prompt spreads over
       several steps while the running sequences go on decoding); a request that had no
       prefill at all (colocated: no first token) gets its first token sampled on the host
       after its prompt's last chunk, accepted like any other token, then runs its first decode
       step in this same step: prefill and decode in one loop
    3. launch the step (graph replay or eager); a batch with a structured-output row launches
       its forward, advances the previous step's constrained rows' matchers while it runs,
       fills their masks (reading the previous step's rows (4.) on a helper thread meanwhile,
       or, below `beside_min_rows` rows, the constrained ones before and the others after),
       then launches its masked sampling
    4. read the PREVIOUS step's tokens (overlap: the device already runs this one), run stop
       checks, advance constrained rows' matchers, stream outputs, free finished sequences
    5. with overlap off, this step is read at once

Every row is sampled on the device inside the step (graph_runner.py), greedy or not, so no
token leaves the device before it is fed to the next step and the host never waits for a
step it has just launched (`sync_reads` counts the reads that did: 0 with overlap on, one per
step with `overlap` off).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.decode_worker.config import DecodeWorkerConfig
from splitserve.decode_worker.graph_runner import GraphRunner, StepHandle
from splitserve.decode_worker.metrics import DecodeMetrics
from splitserve.decode_worker.recompute import recompute_kv, sample_first_tokens
from splitserve.decode_worker.scheduler import DecodeScheduler
from splitserve.decode_worker.sequence import DecodeInput, DecodeSequence, Sink, StepOutput
from splitserve.decode_worker.startup import warm_up
from splitserve.decode_worker.step_reads import BESIDE_MIN_ROWS, StepReads
from splitserve.engine.grammar_masks import grammar_lineages
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.sampler import Sampler
from splitserve.request.block_allocator import BlockAllocator
from splitserve.request.errors import RequestError
from splitserve.request.grammar_cache import GrammarCache
from splitserve.request.stop_checker import StopChecker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSnapshot:
    num_running: int = 0
    num_waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0


class DecodeEngine(StepReads):
    def __init__(
        self,
        cfg: DecodeWorkerConfig,
        runner: ModelRunner | None = None,
        tokenizer=None,
        metrics: DecodeMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.runner = runner or ModelRunner(cfg.engine)
        self.tokenizer = tokenizer
        self.metrics = metrics or DecodeMetrics()
        sc = cfg.engine.scheduler
        self.allocator = BlockAllocator(self.runner.num_blocks)
        self.max_batch_size = sc.max_batch_size
        self.scheduler = DecodeScheduler(
            self.allocator,
            self.runner.block_size,
            sc.max_batch_size,
            self.runner.max_model_len,
            sc.max_queue_len,
            sc.max_num_batched_tokens,
            cfg.prefill_chunk_tokens,
        )
        self.eos = tuple(self.runner.model_config.eos_token_ids)
        self.sampler = Sampler(cfg.engine.seed, self.eos)
        self.graphs = GraphRunner(self.runner, sc.max_batch_size, self.sampler)
        vocab = self.runner.model_config.vocab_size
        self.grammars = GrammarCache(
            cfg.engine.model_path, vocab, self.eos, lineages=grammar_lineages()
        )  # servicer's
        self.grammars.on_compile = self.metrics.grammar_compile_seconds.observe
        self.graphs.masks.on_fill = self.metrics.mask_seconds.observe
        self.sync_reads = 0  # steps read in the engine step that launched them (host waited)
        self._launched: StepHandle | None = None
        self.vocab_size = self.runner.model_config.vocab_size
        self._inflight: StepHandle | None = None
        self._unread: StepHandle | None = None  # within step(): the previous step, until read
        self._rest: list[tuple] | None = None  # its unconstrained rows, read after the launch
        # a masked step with at least this many rows of the previous step to read reads them on
        # a helper thread while the masks fill (smaller ones: the hop costs more than it saves)
        self.beside_min_rows = BESIDE_MIN_ROWS
        # blocks reserved for pulls / streams, not yet admitted or released; while nothing can
        # run for want of them, the engine waits for the next command (engine_loop.py: an
        # admission, a release, an abort) instead of stepping: `blocked`
        self.reserved_blocks, self.blocked = 0, False
        self.load = LoadSnapshot(
            free_blocks=self.allocator.num_free, total_blocks=self.allocator.num_usable
        )

    # ---- start-up --------------------------------------------------------------------------------
    def warm_up(self, zero: bool = True) -> list[int]:
        """Graphs and every shape, before SERVING (startup.py); the captured decode sizes."""
        return warm_up(self, zero)

    # ---- requests --------------------------------------------------------------------------------
    def _new_sequence(
        self, inp: DecodeInput, sink: Sink
    ) -> tuple[DecodeSequence, StepOutput | None]:
        """`inp` was validated at this worker's trust boundary (servicer.py: prompt, vocabulary,
        sampling); the engine builds on it unchecked. `inp.params.stop` is not matched here."""
        prompt = list(inp.prompt_token_ids)
        first_ids = () if inp.first_token_id is None else (inp.first_token_id,)
        stop = StopChecker(
            inp.params, self.eos, self.runner.max_model_len, len(prompt), match_stop_strings=False
        )
        seq = DecodeSequence(inp.request_id, prompt, inp.params, stop, sink, list(first_ids))
        seq.start_grammar(inp.matcher)
        if inp.first_token_id is None:  # colocated: admission computes the prompt, samples out[0]
            return seq, None
        if seq.matcher is not None and not seq.advance_matcher(inp.first_token_id):
            raise RequestError.invalid(
                f"first_token_id {inp.first_token_id} is not allowed by the request's "
                "constraint; pass the token the prefill worker sampled under the same constraint"
            )
        first = stop.update(inp.first_token_id, "")
        done = (
            StepOutput(inp.request_id, (), (), first.finish_reason, first.stop_reason)
            if first.finished
            else None
        )
        return seq, done

    def submit(self, inp: DecodeInput, sink: Sink) -> None:
        """A request without KV: its prompt is recomputed locally when it is admitted."""
        seq, done = self._new_sequence(inp, sink)
        if done is not None:  # the first token already ends it
            sink(done)
            return
        self.scheduler.add(seq)
        self._snapshot()

    def admit(self, inp: DecodeInput, block_ids: Sequence[int], sink: Sink) -> None:
        """A request whose prompt KV is already in `block_ids` (allocated from `self.allocator`
        by the caller, e.g. the KV-transfer pull); the engine owns the blocks from here on."""
        try:
            if inp.first_token_id is None:
                raise RequestError.invalid(
                    "a request with KV needs first_token_id; pass the token the prefill "
                    "worker returned with the handle"
                )
            seq, done = self._new_sequence(inp, sink)
        except RequestError:
            self.release_blocks(block_ids)
            raise
        if done is not None:
            self.release_blocks(block_ids)
            sink(done)
            return
        try:
            self.scheduler.admit(seq, list(block_ids))
        except RequestError:
            self.release_blocks(block_ids)
            raise
        self.reserved_blocks -= len(block_ids)
        self._snapshot()

    def reserve_blocks(self, num_blocks: int) -> list[int] | None:
        """Blocks for a KV pull (None: the pool is short now); `admit` or `release_blocks` next."""
        got = self.allocator.allocate(num_blocks)
        self._snapshot()
        if got is None:
            return None
        self.reserved_blocks += num_blocks
        return list(got.block_ids)

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Gives back reserved blocks that were never admitted. The load snapshot is refreshed
        here, not only by a step: an idle engine runs no step, and GetLoad (the router's
        placement, the tests' "all blocks free") would go on reporting them held."""
        self.allocator.free(block_ids)
        self.reserved_blocks -= len(block_ids)
        self._snapshot()

    def abort(self, request_id: str, reason: str = "abort", error: Exception | None = None) -> bool:
        """Ends a request now: blocks freed, its stream gets a last chunk with `reason`."""
        seq = self.scheduler.by_id.get(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        self.metrics.finished.labels(reason).inc()
        self._emit(seq, StepOutput(request_id, finish_reason=reason, error=error))
        self._snapshot()
        return True

    def abort_all(self, reason: str = "abort", error: Exception | None = None) -> None:
        for rid in list(self.scheduler.by_id):
            self.abort(rid, reason, error)

    @property
    def has_work(self) -> bool:
        return (bool(self.scheduler.by_id) and not self.blocked) or self._inflight is not None

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> None:
        t0 = time.perf_counter()
        self._launched = None
        self._unread, self._inflight = self._inflight, None
        if not self.cfg.overlap:
            self._read_unread()
        batch = self.scheduler.schedule()
        handle = None
        if batch is not None:
            if batch.num_preempted:
                self.metrics.preemptions.inc(batch.num_preempted)
            if batch.prefill:
                self._recompute(batch.prefill)
            seqs = [s for s in batch.seqs if not s.finished]  # a sampled first token may end one
            if seqs:  # a middle prefill chunk leaves the rows as they were: no re-prepare
                handle = self.graphs.launch(
                    seqs, batch.changed, batch.new_blocks, self._read_unread
                )
                self._launched = handle
                (
                    self.metrics.graph_replays if handle.graph_size else self.metrics.eager_steps
                ).inc()
                self.metrics.batch_size.observe(len(seqs))
        elif self._unread is None and self.scheduler.by_id:
            if not self.reserved_blocks:
                raise RuntimeError(
                    "decode scheduler stalled: requests wait but nothing can run or is in flight"
                )
            self.blocked = True  # pulls hold blocks; they come back admitted or released
        self._read_unread()
        if handle is not None:
            if not self.cfg.overlap:
                self._complete(handle)
            else:
                self._inflight = handle
        self._snapshot()
        self.metrics.step_seconds.observe(time.perf_counter() - t0)

    def _recompute(self, slices: list[tuple[DecodeSequence, int, int]]) -> None:
        """Computes this step's local-prefill slices (recompute.py); sequences whose prompt
        ended here and have no first token get it sampled on the host and accepted like any
        token (stops, logprobs, stream)."""
        budget = self.cfg.engine.scheduler.max_num_batched_tokens
        firsts, logits = recompute_kv(self.runner, slices, budget, self.metrics)
        if firsts:
            out = sample_first_tokens(self.sampler, firsts, logits)
            now = time.monotonic()
            for seq, tok, lp in zip(firsts, out.token_ids, out.logprobs):
                self._accept(seq, tok, lp, now)

    def _snapshot(self) -> None:
        free = self.allocator.num_free
        self.load = LoadSnapshot(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            free,
            self.allocator.num_usable,
        )
        m = self.metrics
        m.kv_blocks_free.set(free)
        m.kv_blocks_used.set(self.allocator.num_usable - free)
        m.running.set(self.load.num_running)
        m.waiting.set(self.load.num_waiting)

    def close(self, error: RequestError | None = None) -> None:
        """Ends what is left with `error` (default UNAVAILABLE) and releases the graphs; idempotent."""
        self._inflight = self._rest = None
        self.abort_all(
            "error",
            error
            or RequestError.unavailable(
                "the decode worker is shutting down; retry on another decode worker"
            ),
        )
        self.graphs.release()
        self.graphs.masks.close()
        self.sampler.release_graphs()
