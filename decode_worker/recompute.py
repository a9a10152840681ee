"""Local prefill inside the decode worker: rebuilds admitted sequences' KV from their tokens.

Preempted sequences and requests handed over without KV are recomputed here, in the slices
the scheduler planned for this step (chunked prefill: scheduler.py), packed into prefill
calls of at most max_num_batched_tokens; a sequence with no first token yet (colocated: no
prefill worker ran) gets it sampled on the host from its last prompt position's logits after
its last slice, as the prefill worker would (step 0, same seed rule).
"""

from __future__ import annotations

import torch

from splitserve.decode_worker.metrics import DecodeMetrics
from splitserve.decode_worker.sequence import DecodeSequence
from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.sampler import SampleOutput, Sampler, SeqSamplingInfo


def recompute_kv(
    runner: ModelRunner,
    slices: list[tuple[DecodeSequence, int, int]],
    budget: int,
    metrics: DecodeMetrics,
) -> tuple[list[DecodeSequence], torch.Tensor | None]:
    """Computes the KV of the planned (seq, start, stop) slices of each sequence's
    recompute_tokens() with local prefills of at most `budget` tokens a call; returns the
    sequences whose prompt ended here and that need a first token, and their last prompt
    position's logits (stacked)."""
    chunks: list[PrefillChunk] = []
    lasts: list[tuple[int, DecodeSequence]] = []  # (chunk index, seq): a prompt's last chunk
    firsts: list[DecodeSequence] = []
    rows: list[torch.Tensor] = []

    def run() -> None:
        logits = runner.prefill(chunks)
        for i, seq in lasts:
            firsts.append(seq)
            rows.append(logits[i])

    used = 0
    for seq, begin, end in slices:
        tokens = seq.recompute_tokens()
        (metrics.prompt_tokens if seq.needs_first_token else metrics.recomputed_tokens).inc(
            end - begin
        )
        start = begin
        while start < end:
            take = min(end - start, budget - used)
            chunks.append(PrefillChunk(tokens[start : start + take], start, seq.block_ids))
            start += take
            used += take
            if start == len(tokens) and seq.needs_first_token:
                lasts.append((len(chunks) - 1, seq))
            if used == budget:
                run()
                chunks, lasts, used = [], [], 0
    if chunks:
        run()
    return firsts, (torch.stack(rows) if firsts else None)


def sample_first_tokens(
    sampler: Sampler, seqs: list[DecodeSequence], logits: torch.Tensor
) -> SampleOutput:
    """out[0] of prompts computed here, sampled on the host as the prefill worker does."""
    infos = [SeqSamplingInfo(s.params, s.prompt_token_ids, [], s.matcher) for s in seqs]
    return sampler.sample(logits, infos)
