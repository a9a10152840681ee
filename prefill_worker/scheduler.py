"""Context-only scheduling: which prompt tokens the next step computes.

    add() ──▶ waiting (FIFO, at most max_queue_len) ──admit──▶ running ──last chunk──▶ (engine)
                                          │
               admit = prefix-cache match + a reference on EVERY block the prompt needs,
               so a chunked prompt never stalls half-way for memory

    each step, under max_num_batched_tokens tokens and max_batch_size sequences:
      1. running sequences, oldest first, each its next chunk (as much as the budget allows)
      2. then waiting sequences in arrival order, while the budget lasts and the pool has
         their blocks; when the head does not fit, nobody behind it jumps the queue

All methods run on the engine's event-loop thread; the scheduler never touches the model.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from splitserve.config.engine_config import SchedulerConfig
from splitserve.prefill_worker.prefix_cache import PrefixCache
from splitserve.prefill_worker.request import PrefillSeq
from splitserve.request.errors import RequestError
from splitserve.request.retry_hint import QueueDrainRate


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: PrefillSeq
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        return self.end == len(self.seq.prompt)


class PrefillScheduler:
    def __init__(self, cache: PrefixCache, cfg: SchedulerConfig) -> None:
        self.cache = cache
        self.cfg = cfg
        self.block_size = cache.block_size
        self.waiting: deque[PrefillSeq] = deque()
        self.running: list[PrefillSeq] = []
        self.drain = QueueDrainRate()  # for the retry hint of a full queue

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def add(self, seq: PrefillSeq) -> None:
        """Queues a validated request; RESOURCE_EXHAUSTED when the prompt could never fit in the
        pool (no retry hint: waiting cannot help) or the queue is full (with a retry hint,
        request/retry_hint.py)."""
        need, usable = self.blocks_for(len(seq.prompt)), self.cache.allocator.num_usable
        if need > usable:
            raise RequestError.exhausted(
                f"the prompt needs {need} KV blocks but this worker's pool has {usable}; "
                "shorten the prompt or run the worker with more --num-blocks"
            )
        if len(self.waiting) >= self.cfg.max_queue_len:
            raise RequestError.exhausted(
                f"prefill queue is full ({len(self.waiting)} waiting, max_queue_len "
                f"{self.cfg.max_queue_len}); retry later or on another prefill worker",
                retry_after_s=self.drain.retry_after_s(len(self.waiting)),
            )
        self.waiting.append(seq)

    def remove(self, seq: PrefillSeq) -> None:
        """Forgets a finished or aborted sequence (its blocks are the caller's business)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> PrefillSeq | None:
        return next((s for s in (*self.running, *self.waiting) if s.request_id == request_id), None)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.cfg.max_num_batched_tokens
        out: list[ScheduledChunk] = []

        def take(seq: PrefillSeq) -> None:
            nonlocal budget
            n = min(seq.num_remaining, budget)
            out.append(ScheduledChunk(seq, seq.num_computed, seq.num_computed + n))
            budget -= n

        for seq in self.running:
            if budget == 0 or len(out) >= self.cfg.max_batch_size:
                return out
            take(seq)
        while self.waiting and budget > 0 and len(out) < self.cfg.max_batch_size:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            self.drain.admitted()
            self.running.append(seq)
            take(seq)
        return out

    def _admit(self, seq: PrefillSeq) -> bool:
        hits = self.cache.match(seq.prompt, seq.block_keys)
        table = self.cache.acquire(hits, self.blocks_for(len(seq.prompt)) - len(hits))
        if table is None:
            return False
        seq.block_table = table
        seq.num_computed = seq.num_cached = len(hits) * self.block_size
        seq.num_registered = len(hits)
        seq.admitted_at = time.perf_counter()
        return True
