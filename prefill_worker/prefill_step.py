"""One prefill step's pieces, around the engine loop (engine.py) that schedules and awaits it.

step_inputs(batch)      loop thread: the scheduled chunks as model input + rows to sample
run_step(...)           step thread: the model, then the first tokens of finished prompts
register_full_blocks    loop thread, after the step: newly full blocks into the prefix cache
finish_prefill          loop thread: a finished prompt's lease (or freed blocks), metrics,
                        its future resolved with the PrefillResult
constraint_failed       loop thread: instead, when token 0's mask hit a grammar engine limit
"""

from __future__ import annotations

import time

import torch

from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.sampler import SampleOutput, Sampler, SeqSamplingInfo
from splitserve.prefill_worker.leases import LeaseTable
from splitserve.prefill_worker.metrics import PrefillMetrics
from splitserve.prefill_worker.prefix_cache import PrefixCache
from splitserve.prefill_worker.request import PrefillResult, PrefillSeq
from splitserve.prefill_worker.scheduler import ScheduledChunk
from splitserve.request.constraint import limits_exceeded
from splitserve.request.errors import RequestError
from splitserve.request.grammar_cache import GrammarCache
from splitserve.request.stop_checker import StopChecker


def step_inputs(
    batch: list[ScheduledChunk],
) -> tuple[list[PrefillChunk], list[int], list[SeqSamplingInfo]]:
    """(chunks, rows, infos): one PrefillChunk per scheduled chunk; the rows (chunk indices) that
    end a prompt, whose logits give its first token; their sampling infos."""
    chunks = [
        PrefillChunk(c.seq.prompt[c.start : c.end], c.start, tuple(c.seq.block_table))
        for c in batch
    ]
    rows = [i for i, c in enumerate(batch) if c.is_last]
    infos = [
        SeqSamplingInfo(batch[i].seq.params, batch[i].seq.prompt, (), batch[i].seq.matcher)
        for i in rows
    ]
    return chunks, rows, infos


def run_step(
    runner: ModelRunner,
    sampler: Sampler,
    chunks: list[PrefillChunk],
    rows: list[int],
    infos: list[SeqSamplingInfo],
    delay_s: float = 0.0,
) -> tuple[SampleOutput | None, float]:
    """Runs in the step thread: the model, then the first tokens of the prompts it finished
    (after `delay_s`: the faults config's slow last chunk, tests only); returns them and the
    sampling's seconds."""
    if delay_s:
        time.sleep(delay_s)
    logits = runner.prefill(chunks)
    if not rows:
        return None, 0.0
    with SamplingTimer(logits.device) as timer:
        sampled = sampler.sample(logits[rows], infos)
    return sampled, timer.seconds


class SamplingTimer:
    """How long the sampling took on the device: CUDA events around it, read after the sampler
    has synchronised anyway (no extra host wait); wall time on CPU."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self.seconds = 0.0

    def __enter__(self) -> SamplingTimer:
        if self._cuda:
            self._start, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda:
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1000
        else:
            self.seconds = time.perf_counter() - self._t0


def register_full_blocks(cache: PrefixCache, seq: PrefillSeq, block_size: int) -> None:
    """Publishes `seq`'s computed full blocks not yet in the prefix cache (each once)."""
    full = min(seq.num_computed // block_size, len(seq.block_keys))  # none: queued cache-off
    cache.register_run(seq.block_table, seq.block_keys, seq.num_registered, full, seq.prompt)
    seq.num_registered = max(seq.num_registered, full)


def finish_prefill(
    seq: PrefillSeq,
    token_id: int,
    logprob,
    eos: tuple[int, ...],
    max_model_len: int,
    cache: PrefixCache,
    leases: LeaseTable,
    metrics: PrefillMetrics,
) -> None:
    """`seq`'s prompt is computed and `token_id` is its first token (`seq` already left the
    scheduler): its blocks become a lease, or are freed when that token already ends the request;
    the metrics are counted and `seq.future` gets the PrefillResult."""
    # no text here: stop strings are for the router (and the decode worker's event loop)
    stop = StopChecker(
        seq.params, eos, max_model_len, len(seq.prompt), match_stop_strings=False
    ).update(token_id, "")
    table, seq.block_table = seq.block_table, []
    if stop.finish_reason is not None:
        cache.free(table)
        lease = None
    else:
        lease = leases.grant(seq.request_id, tuple(table), len(seq.prompt), seq.lease_ttl_s)
    m = metrics
    now = time.perf_counter()
    admitted = seq.admitted_at or now
    m.ttft_seconds.observe(now - seq.arrival)
    m.queue_seconds.observe(admitted - seq.arrival)
    m.count_prompt(len(seq.prompt), seq.num_cached)
    m.requests.labels("finished" if lease is None else "leased").inc()
    seq.future.set_result(
        PrefillResult(
            seq.request_id,
            token_id,
            logprob,
            stop.finish_reason,
            stop.stop_reason,
            len(seq.prompt),
            seq.num_cached,
            lease,
            queue_time_s=admitted - seq.arrival,
            compute_time_s=now - admitted,
            sampling_time_s=seq.sampling_time_s,
            handover_start_s=0.0 if lease is None else time.perf_counter() - seq.arrival,
        )
    )


def constraint_failed(seq: PrefillSeq, grammars: GrammarCache, cache: PrefixCache, hub) -> bool:
    """True when `seq`'s token-0 mask hit a grammar engine limit (llguidance then allows only EOS,
    which must not pass for a finished answer; the compile's probe computed that mask, so this
    is rare): its future gets INVALID_ARGUMENT (the servicer counts the outcome), its blocks are
    freed (`seq` already left the scheduler), the grammar's broken compiles dropped."""
    if seq.matcher is None or not seq.matcher.is_error():
        return False
    err = RequestError.invalid(limits_exceeded(1, seq.matcher.get_error()))
    grammars.discard(seq.params.constraint)  # a lexer past a limit stays broken for its copies
    if hub is not None:  # (a KV stream of it ends)
        hub.aborted(seq.request_id, err.message)
    cache.free(seq.block_table)
    seq.block_table = []
    seq.future.set_exception(err)
    return True
