"""Warm-up of every prefill shape before a worker says SERVING, so no request waits on a kernel
compilation (kernels/compile_counter.py counts them; the workers export the count).

What makes a Triton kernel compile again is its specialisation, not the token count: the
kernels take the token count as their grid, and an int argument is specialised only on being
1 or a multiple of 16 (pointers on 16-byte alignment, which every fresh tensor has). So the
classes a prefill step can meet are, per kernel family:

    layers     total tokens T: 1, 2, 3-4 (the small-M GEMV kernels at their BLOCK_M 1, 2, 4;
               ops.SMALL_M_MAX), or more (norm / RoPE / SiLU kernels + cuBLAS)
    lm_head    sequences R (one logits row each): 1, 2, 3-4 (GEMV), or more
    attention  block-table width W: 1, a multiple of 16, or any other (its `max_blocks` and
               row stride arguments), on each path: a step of few sequences and tokens may
               run the fused pieces (static metadata), others the plain path (spec_keys)

`warmup_batches` covers the union of the classes reachable under the worker's limits, each
with a few batches of null-block tables; on CUDA it adds one step of every token bucket (16,
32, ... up to max_num_batched_tokens), which also sizes the caching allocator and cuBLAS's
choices before serving. The sampler is warmed in each variant the first token can take
(greedy, random, + filters, + logprobs; the state tables are of fixed width: sampler.py), each
also as a constrained request's (an all-allowed token mask: the masked eager path, and with
logprobs the raw-logprob kernels), and the KV pack / unpack kernels of the hand-over on the
null block. Every write lands in the null
block; the caller zeroes the pool after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.grammar_masks import mask_words
from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.prefill_graphs import FUSED_MAX_TOKENS, FUSED_SEQS
from splitserve.engine.sampler import Sampler, SeqSamplingInfo
from splitserve.engine.sampler_graphs import GRAPH_ROWS
from splitserve.kernels import ops
from splitserve.request.block_allocator import NULL_BLOCK
from splitserve.request.constraint import Constraint
from splitserve.request.sampling_params import SamplingParams

SMALLEST_BUCKET = 16


@dataclass(frozen=True)
class WarmSeq:
    """One sequence of a warm-up batch: `tokens` new tokens after `computed`, `width` blocks."""

    tokens: int
    computed: int
    width: int


def size_class(n: int) -> str:
    """The small-M class of a row count (kernels/ops.py: GEMV at <= SMALL_M_MAX rows)."""
    if n > ops.SMALL_M_MAX:
        return "many"
    return {1: "1", 2: "2"}.get(n, "3-4")


def width_class(width: int) -> str:
    """How Triton specialises an int argument: 1, a multiple of 16, or neither."""
    return "1" if width == 1 else ("x16" if width % 16 == 0 else "other")


def spec_keys(batch: Sequence[WarmSeq]) -> set[tuple[str, ...]]:
    """The (kernel family, class...) keys one prefill step of `batch` compiles, if never seen.
    Attention is keyed by the path too: a step of few sequences and tokens may run the fused
    pieces (prefill_graphs.py: attention captured over static metadata), any other the plain
    path's eager attention over the step's own block tables."""
    total = sum(s.tokens for s in batch)
    width = max(s.width for s in batch)
    many = len(batch) > FUSED_SEQS or total > FUSED_MAX_TOKENS
    return {
        ("layers", size_class(total)),
        ("lm_head", size_class(len(batch))),
        ("attention", width_class(width), "many" if many else "few"),
    }


def token_buckets(max_tokens: int, smallest: int = SMALLEST_BUCKET) -> list[int]:
    """Powers of two from `smallest` below `max_tokens`, then `max_tokens` itself."""
    out, t = [], smallest
    while t < max_tokens:
        out.append(t)
        t *= 2
    return [*out, max_tokens]


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _split(total: int, max_len: int, max_seqs: int, block_size: int) -> list[WarmSeq] | None:
    """`total` tokens as sequences of at most `max_len` tokens (None: more than `max_seqs`)."""
    seqs = []
    while total > 0:
        take = min(total, max_len)
        seqs.append(WarmSeq(take, 0, _blocks(take, block_size)))
        total -= take
    return seqs if len(seqs) <= max_seqs else None


def warmup_batches(
    block_size: int,
    max_blocks_per_seq: int,
    max_num_batched_tokens: int,
    max_batch_size: int,
    max_model_len: int,
    buckets: bool,
) -> list[list[WarmSeq]]:
    """Batches whose steps together meet every reachable class of `spec_keys` (and, with
    `buckets`, every token bucket); each fits the limits the scheduler enforces."""
    max_tokens = min(max_num_batched_tokens, max_batch_size * max_model_len)
    wide = [w for w in (1, 2, 16) if w <= max_blocks_per_seq]
    batches: list[list[WarmSeq]] = []
    classes = (1, 2, ops.SMALL_M_MAX, ops.SMALL_M_MAX + 1)  # one count of each size_class
    for rows in sorted({min(r, max_batch_size, max_tokens) for r in classes}):  # lm_head
        batches.append([WarmSeq(1, 0, 1)] * rows)
    for total in sorted({min(t, max_tokens) for t in classes}):  # layers, one sequence if it fits
        split = _split(total, max_model_len, max_batch_size, block_size)
        if split is not None:
            batches.append(split)
    for w in wide:  # attention classes at few and many tokens, after a cached prefix if it fits
        for t in {1, min(max_tokens, max_model_len, ops.SMALL_M_MAX + 1, w * block_size)}:
            computed = max(0, min(w * block_size - t, block_size, max_model_len - t))
            batches.append([WarmSeq(t, computed, w)])
            # the same width among more sequences than the fused pieces take: the plain path
            if max_batch_size > FUSED_SEQS and t + FUSED_SEQS <= max_tokens:
                batches.append([WarmSeq(t, computed, w), *[WarmSeq(1, 0, 1)] * FUSED_SEQS])
    if buckets:
        for t in token_buckets(max_tokens):
            split = _split(t, max_model_len, max_batch_size, block_size)
            if split is not None:
                batches.append(split)
    return batches


def covered(batches: Sequence[Sequence[WarmSeq]]) -> set[tuple[str, str]]:
    return set().union(*(spec_keys(b) for b in batches))


# a constrained request's first token: the sampler's masked eager path (sampler.py: never its
# graphs; with logprobs, the raw logprobs of the unmasked logits: raw_logprobs_device)
ANY_JSON = Constraint(kind="json_object")
CONSTRAINED = (
    SamplingParams(temperature=0.0, constraint=ANY_JSON),
    SamplingParams(temperature=0.0, logprobs=2, constraint=ANY_JSON),
    SamplingParams(temperature=1.0, seed=1, top_k=5, top_p=0.9, constraint=ANY_JSON),
    SamplingParams(temperature=1.0, seed=1, top_p=0.9, logprobs=2, constraint=ANY_JSON),
)


# one row (a graph replay on CUDA, unless constrained), then more rows than the graphs take: the
# eager path in both of Triton's int classes (multiple of 16 or not)
SAMPLER_ROWS = (1, GRAPH_ROWS + 1, 2 * GRAPH_ROWS)


def _warm_sampler(sampler: Sampler, logits: torch.Tensor) -> None:
    """Each path the first token's sampling takes: argmax, random, + filters, + logprobs, and
    each of those under a token mask (all allowed) at every row count: a constrained row takes
    the eager path even at one row."""
    row = logits[:1].float()
    variants = (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=1.0, seed=1, top_k=5, top_p=0.9),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.0, seed=1, top_p=0.9, logprobs=2),
        SamplingParams(
            temperature=0.7,
            seed=1,
            repetition_penalty=1.1,
            min_tokens=1,
            stop_token_ids=(1,),
            logit_bias=((1, 1.0),),
        ),
    )
    words = mask_words(row.shape[1])
    for n in SAMPLER_ROWS:
        x = row.expand(n, -1)
        for params in variants:
            sampler.sample(x.clone(), [SeqSamplingInfo(params, [0], ())] * n)
        allowed = torch.full((n, words), -1, dtype=torch.int32, device=row.device)
        for params in CONSTRAINED:
            sampler.sample(x.clone(), [SeqSamplingInfo(params, [0], ())] * n, allowed)


def _warm_kv_copy(runner: ModelRunner) -> None:
    """The hand-over's pack (prefill side) and unpack (decode side), on the null block."""
    for n in (1, 2, 16):
        ids = torch.full((n,), NULL_BLOCK, dtype=torch.int64, device=runner.device)
        packed = ops.pack_kv_blocks(runner.kv_cache, ids)
        ops.unpack_kv_blocks(packed, runner.kv_cache, ids)


def warm_up_prefill(
    runner: ModelRunner, sampler: Sampler, max_num_batched_tokens: int, max_batch_size: int
) -> int:
    """Runs every warm-up batch (null-block tables), the sampler and the KV copies; returns the
    number of prefill steps run. The caller zeroes the pool afterwards."""
    batches = warmup_batches(
        runner.block_size,
        runner.max_blocks_per_seq,
        max_num_batched_tokens,
        max_batch_size,
        runner.max_model_len,
        buckets=runner.device.type == "cuda",  # nothing compiles on CPU: keep tests quick
    )
    logits = None
    for batch in batches:
        chunks = [PrefillChunk([0] * s.tokens, s.computed, [NULL_BLOCK] * s.width) for s in batch]
        logits = runner.prefill(chunks)
    _warm_sampler(sampler, logits)
    _warm_kv_copy(runner)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return len(batches)
