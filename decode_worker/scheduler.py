"""Continuous batching for the decode worker: who runs in the next step, and with which blocks.

    waiting (FIFO; preempted sequences go back to the front)
       │ admit: batch has room and the pool has the blocks the sequence needs
       ▼
    running (row order = admission order; a step runs every running sequence that may step)
       │ finish (stop / eos / length), abort: blocks freed at once
       │ preempt (pool exhausted while growing): the NEWEST running sequence frees its
       ▼   blocks and goes back to the front of waiting, to be recomputed on re-admission
    (when nothing runs and the head of waiting does not fit, waiting sequences that hold KV
     give it back too, newest first: the head alone always fits, see `_check_new`)

Blocks: a sequence admitted through `admit(seq, block_ids)` brings its prompt's KV in blocks
the caller allocated from `allocator` (the KV-transfer seam: allocate, pull, admit); a
sequence queued with `add(seq)` has no KV and is recomputed with a local prefill when
admitted (the engine runs it; `ScheduledBatch.prefill` lists the slices). A sequence without
a first token (colocated: no prefill happened) is admitted the same way with blocks up to
position P; the engine samples its first token after its last slice and drops it from the
step's rows if that token finishes it. Each step a sequence crossing a block boundary gets
one more block.

Chunked prefill (`prefill_chunk_tokens` > 0, the default): each step computes at most that
many local-prefill tokens, before the step's decode, so a long prompt is spread over several
steps and the running sequences keep stepping between its chunks (the decode step's latency
grows by one chunk, not by the whole prompt; vLLM and SGLang mix prefill chunks into decode
steps under a token budget the same way). Prefills under way go first (oldest first), then a
waiting sequence without KV is admitted only while the step's budget has tokens left; an
admitted sequence holds the blocks of its whole prompt from admission and joins the decode
rows in the step of its last slice. With 0, every admitted prompt is computed whole in the
step that admits it (its admission is bounded by `max_recompute_tokens`, the first always
admitted).

Freed blocks may still be written by a step in flight (overlap); every KV writer of this
worker (decode steps, the recompute prefill) runs on the one compute stream, so the GPU
orders those writes before any new owner's. A writer on another stream (the UCX pull) must
wait for the compute stream at allocation time.

The scheduler is host bookkeeping only: it never touches the model or the device.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from splitserve.decode_worker.sequence import DecodeSequence, Status
from splitserve.request.block_allocator import BlockAllocator
from splitserve.request.errors import RequestError
from splitserve.request.retry_hint import QueueDrainRate


@dataclass
class ScheduledBatch:
    seqs: list[DecodeSequence]  # rows of the step, in order
    changed: bool  # rows differ from the previous step's: the runner re-prepares everything
    # local prefill before the step: (seq, start, stop) slices of seq.recompute_tokens()
    prefill: list[tuple[DecodeSequence, int, int]] = field(default_factory=list)
    new_blocks: list[tuple[DecodeSequence, int, int]] = field(
        default_factory=list
    )  # (seq, column, block)
    num_preempted: int = 0


class DecodeScheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_batch_size: int,
        max_model_len: int,
        max_queue_len: int,
        max_recompute_tokens: int,
        prefill_chunk_tokens: int = 0,
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.max_recompute_tokens = max_recompute_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens  # 0: whole prompts (module doc)
        self.waiting: deque[DecodeSequence] = deque()
        self.running: list[DecodeSequence] = []
        self.by_id: dict[str, DecodeSequence] = {}
        self._admitted = 0
        self._last_rows: tuple[int, ...] = ()
        self.num_preemptions = 0
        self.drain = QueueDrainRate()  # for the retry hint of a full queue

    # ---- sizes -------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _missing_blocks(self, seq: DecodeSequence) -> int:
        """Blocks the sequence lacks for its next step (which writes position next_position;
        P for a sequence whose first token its admission samples)."""
        return self.blocks_for(seq.admit_position + 1) - len(seq.block_ids)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """RESOURCE_EXHAUSTED, without a retry hint (waiting cannot help), for a request whose
        prompt + max_tokens need more blocks than the whole pool. Reads only constants, so the
        servicer may call it from the event loop before pulling any KV."""
        worst = min(prompt_len + max_tokens, self.max_model_len)
        if self.blocks_for(worst) > self.allocator.num_usable:
            raise RequestError.exhausted(
                f"prompt + max_tokens need up to {self.blocks_for(worst)} KV blocks but this worker's pool "
                f"holds {self.allocator.num_usable}; lower max_tokens or raise cache.num_blocks"
            )

    # ---- entry points ----------------------------------------------------------------------
    def _check_new(self, seq: DecodeSequence) -> None:
        if seq.request_id in self.by_id:
            raise RequestError.invalid(
                f"request_id {seq.request_id!r} is already in flight on this worker; "
                "use a unique id per request"
            )
        self.check_fits(seq.prompt_len, seq.params.max_tokens)
        if len(self.waiting) >= self.max_queue_len:  # a hint: it fits once the queue drains
            raise RequestError.exhausted(
                f"decode queue is full ({self.max_queue_len} waiting); retry later "
                "or on another decode worker",
                retry_after_s=self.drain.retry_after_s(len(self.waiting)),
            )

    def add(self, seq: DecodeSequence) -> None:
        """Queues a sequence without KV: it is recomputed locally when admitted."""
        self._check_new(seq)
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq

    def admit(self, seq: DecodeSequence, block_ids: list[int]) -> None:
        """Queues a sequence whose prompt KV is already in `block_ids` (allocated by the caller
        from `self.allocator`; the scheduler owns them from now on and frees them)."""
        need = self.blocks_for(seq.prompt_len)
        if len(block_ids) != need:
            raise RequestError.invalid(
                f"prompt of {seq.prompt_len} tokens needs {need} blocks, got {len(block_ids)}"
            )
        self._check_new(seq)
        seq.block_ids = list(block_ids)
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq

    def finish(self, seq: DecodeSequence) -> None:
        """Removes a finished or aborted sequence and frees its blocks (idempotent)."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED
        self.by_id.pop(seq.request_id, None)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch (None when nothing can run)."""
        new_blocks: list[tuple[DecodeSequence, int, int]] = []
        preempted = 0
        for seq in list(self.running):  # oldest first, so the newest are preempted first
            if seq.status is not Status.RUNNING or not self._may_step(seq):
                continue
            while self._missing_blocks(seq) > 0:
                got = self.allocator.allocate(1)
                if got is not None:
                    new_blocks.append((seq, len(seq.block_ids), got.block_ids[0]))
                    seq.block_ids.append(got.block_ids[0])
                    continue
                victim = max(self.running, key=lambda s: s.admit_order)
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
        slices: list[tuple[DecodeSequence, int, int]] = []
        budget = self.prefill_chunk_tokens or math.inf
        for seq in self.running:  # prefills under way first, oldest first
            if seq.prefilling and budget > 0:
                budget -= self._plan_slice(seq, budget, slices)
        self._admit_waiting(budget, slices)
        batch = [s for s in self.running if self._may_step(s)]
        if not batch and not slices:
            self._last_rows = ()
            return None
        rows = tuple(s.uid for s in batch)
        changed = rows != self._last_rows
        self._last_rows = rows
        steady_blocks = [] if changed else [c for c in new_blocks if c[0].status is Status.RUNNING]
        return ScheduledBatch(batch, changed, slices, steady_blocks, preempted)

    def _may_step(self, seq: DecodeSequence) -> bool:
        return not seq.prefilling and seq.may_step(seq.params.max_tokens, self.max_model_len)

    @staticmethod
    def _plan_slice(
        seq: DecodeSequence, budget: float, slices: list[tuple[DecodeSequence, int, int]]
    ) -> int:
        """Plans the next slice of `seq`'s local prefill within `budget` tokens; a slice that
        reaches the end makes it a decode row of this step. Returns the tokens planned."""
        total = len(seq.recompute_tokens())
        start = seq.prefill_pos or 0
        stop = int(min(total, start + budget))
        slices.append((seq, start, stop))
        seq.prefill_pos = None if stop == total else stop
        return stop - start

    def _admit_waiting(self, budget: float, slices: list[tuple[DecodeSequence, int, int]]) -> None:
        whole_budget = self.max_recompute_tokens  # prefill_chunk_tokens 0: the admission bound
        admitted_kv = False
        rows = sum(1 for s in self.running if s.prefilling or self._may_step(s))
        while self.waiting and rows < self.max_batch_size:
            seq = self.waiting[0]
            if seq.in_flight:  # preempted with a token still in flight: re-admit once it is read
                break
            needs_kv = not seq.has_kv
            if needs_kv and self._no_room_to_prefill(seq, budget, admitted_kv, whole_budget):
                break
            missing = self._missing_blocks(seq)
            got = self.allocator.allocate(max(missing, 0))
            if got is None and not self.running and self._evict_waiting_kv(seq):
                continue  # nothing runs: waiting KV holders made room (the head alone always fits)
            if got is None:
                break
            self.waiting.popleft()
            self.drain.admitted()
            seq.block_ids.extend(got.block_ids)
            seq.status = Status.RUNNING
            if not seq.admitted_at:  # the first admission ends its decode queue (TTFT timings)
                seq.admitted_at = time.monotonic()
            self._admitted += 1
            seq.admit_order = self._admitted
            self.running.append(seq)
            rows += 1
            if needs_kv:
                admitted_kv = True
                whole_budget -= len(seq.recompute_tokens())
                seq.prefill_pos = 0
                budget -= self._plan_slice(seq, budget, slices)

    def _no_room_to_prefill(
        self, seq: DecodeSequence, budget: float, admitted_kv: bool, whole_budget: int
    ) -> bool:
        """Chunked: the step's prefill budget is spent; whole prompts: another prompt was
        admitted this step and `seq`'s does not fit what is left of max_recompute_tokens."""
        if self.prefill_chunk_tokens:
            return budget <= 0
        return admitted_kv and len(seq.recompute_tokens()) > whole_budget

    def _evict_waiting_kv(self, head: DecodeSequence) -> bool:
        """Frees the KV of a waiting sequence (newest first) other than `head`; it will be
        recomputed on admission. Without it, waiting KV holders could starve the head forever."""
        for seq in reversed(self.waiting):
            if seq is not head and seq.has_kv:
                self._free(seq)
                return True
        return False

    def _preempt(self, seq: DecodeSequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.prefill_pos = None  # its KV is gone: re-admission starts its prefill again
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free(self, seq: DecodeSequence) -> None:
        if seq.block_ids:
            self.allocator.free(seq.block_ids)
            seq.block_ids = []
