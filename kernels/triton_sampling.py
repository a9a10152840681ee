"""Sampling without a vocabulary sort, in a fixed number of launches (engine/sampling_math.py
has the rules and the torch twin; this is the same result on the GPU, capturable).

    prep    (row x chunk)  bias, min_tokens bans and penalties in place; row max; greedy rows
                           done (kernels/triton_sampling_prep.py)
    compact (row x chunk)  filters only: top-k rows list the tokens above their bound, the
                           last program reads the k-th largest and, without top-p, races the
                           listed tokens at or above it: the row is done
                           (kernels/triton_sampling_topk.py)
    radix   (row x chunk)  filters only, 4 launches: the k-th largest of the rows compaction
                           could not serve (a near-constant row), 8 bits at a time
    race    (row x chunk)  the seeded race by rejection: round 1 races every random row left
                           (rows without top-p are done), round 2 (filters only) checks the
                           top-p candidates without drawing noise, rounds 3-5 check and race
                           the rows still undecided
    exact   (row)          filters only: races and checks the few rows left, in a loop
                           (kernels/triton_sampling_race.py)

A row's token is the argmax over its kept set of z + Gumbel(hash(seed, step, token)) whichever
launch decides it, so it matches the twin and never depends on the rows beside it (the chunk
split is a function of the vocabulary only). The last program of each row finishes it: the
token, and its state slot's step and output count advanced by `live`.
"""

from __future__ import annotations

import torch

from splitserve.kernels.triton_common import interpreting, pow2
from splitserve.kernels.triton_sampling_prep import prep_kernel
from splitserve.kernels.triton_sampling_race import exact_kernel, race_kernel
from splitserve.kernels.triton_sampling_topk import compact_kernel, radix_kernel

CHUNK = 4096  # tokens per program
SUB = 128  # tokens per sub-block of a top-k row's bound (k up to V / SUB)
CAP = 1024  # most tokens a top-k row's compaction lists (more: the radix select)
# race launches of a filtered step (True: race, False: only check the top-p candidates): a
# candidate passes with probability >= top_p, and a launch costs work only for the rows still
# undecided, so a few rounds leave almost nothing to the slow single-program loop
RACE_ROUNDS = (True, False, True, True, True)
RACE_SPAN = 2  # chunks per race program (2, 4 warps: the best of spans 2-8, warps 4-8 at batch 256)
RACE_WARPS = 4


def split_of(vocab: int, chunk: int | None = None) -> tuple[int, int]:
    """(tokens per program, tokens per sub-block) of a row of `vocab` logits."""
    chunk = chunk or min(CHUNK, pow2(vocab))
    return chunk, min(SUB, chunk)


def sample_rows(
    x: torch.Tensor,
    slots: torch.Tensor,
    live: torch.Tensor,
    out: torch.Tensor,
    state,
    frozen_slot: int = -1,
    filters: bool = True,
    chunk: int | None = None,
    lp=None,
) -> None:
    """out[r] = token of row r of the fp32 logits x [n, V] (bias, bans and penalties applied
    to x in place) under state slot slots[r]; slots' step and counts advance by live[r]
    (none for frozen_slot). filters=False promises no row has top-k / top-p. `chunk` (a
    power of two) overrides the split, for tests. `lp` (triton_logprobs.LogprobScratch, same
    chunking): the first pass also takes the raw logprob stats of the rows that want them.
    """
    n, vocab = x.shape
    if n == 0:
        return
    s, dev = state, x.device
    chunk, _ = split_of(vocab, chunk)
    c = -(-vocab // chunk)
    f32, i64 = torch.float32, torch.int64
    part_v = torch.empty(n, c, dtype=f32, device=dev)
    part_i = torch.empty(n, c, dtype=i64, device=dev)
    part_e = torch.empty(n, c, dtype=f32, device=dev)
    krem = torch.empty(n, dtype=i64, device=dev)
    prefix = torch.empty(n, dtype=i64, device=dev)
    nsub = max(1, chunk // SUB)
    submax = torch.empty(n, c, nsub, dtype=f32, device=dev)
    zt = torch.empty(n, dtype=f32, device=dev)
    ticket = torch.zeros(n, dtype=torch.int32, device=dev)
    status = torch.ones(n, dtype=torch.int32, device=dev)
    m = torch.empty(n, dtype=f32, device=dev)
    lo = torch.empty(n, dtype=f32, device=dev)
    cand = torch.empty(n, dtype=i64, device=dev)
    zc = torch.zeros(n, dtype=f32, device=dev)
    mass = torch.ones(n, dtype=f32, device=dev)
    common = (x, x.stride(0), vocab, slots, live, out, frozen_slot)
    cp = pow2(c)
    if lp is not None:
        assert lp.chunk == chunk and lp.nsub == nsub, "logprob scratch chunked like the sampler"
        lp_args = (s.wants_logprobs, lp.part_m, lp.part_s, lp.submax, lp.lse, lp.bound, lp.side,
                   lp.mod)  # fmt: skip
    else:
        lp_args = (s.wants_logprobs,) + (m,) * 7  # never read (LOGPROBS=False)
    prep_kernel[(n, c)](
        *common,
        s.temperature, s.top_k, s.min_p, s.step, s.min_tokens,
        s.has_pen, s.rep, s.freq, s.pres, s.counts, s.prompt_seen, s.counts.stride(0),
        s.bias_ids, s.bias_vals, s.bias_ids.shape[1], s.ban_ids, s.ban_ids.shape[1],
        part_v, part_i, ticket, m, status, lo, krem, prefix, submax, zt, c,
        *lp_args, CHUNK=chunk, WP=pow2(s.bias_ids.shape[1]), BP=pow2(s.ban_ids.shape[1]), CP=cp,
        NSUB=nsub, SP=pow2(c * nsub), LOGPROBS=lp is not None, NTOP=lp.ntop if lp else 1, num_warps=8,
    )  # fmt: skip
    fast = not interpreting()  # the GPU's approximate log (the interpreter has none)
    if filters:
        count = torch.zeros(n, dtype=torch.int32, device=dev)
        listed = torch.empty(n, CAP, dtype=i64, device=dev)
        compact_kernel[(n, c)](
            *common, s.temperature, s.top_p, s.seed, s.step, s.counts, s.counts.stride(0),
            m, status, lo, zt, krem, count, listed, ticket, c, CHUNK=chunk, CAP=CAP, FAST=fast,
            num_warps=8,
        )  # fmt: skip
        hist = torch.empty(n, c, 256, dtype=torch.int32, device=dev)
        for shift in (24, 16, 8, 0):
            radix_kernel[(n, c)](
                x, x.stride(0), vocab, slots, s.temperature, m, status, lo, krem, prefix,
                hist, ticket, c, CHUNK=chunk, SHIFT=shift, CP=cp, num_warps=8,
            )  # fmt: skip
    row_state = (m, status, lo, cand, zc, mass)
    block = min(chunk, 1024)
    # the race's programs loop over RACE_SPAN chunks each: fewer, longer programs pay the
    # per-program start (dependent loads, the ticket's fence) fewer times
    rchunk = chunk * RACE_SPAN
    rc = -(-vocab // rchunk)
    for race in RACE_ROUNDS if filters else RACE_ROUNDS[:1]:
        race_kernel[(n, rc)](
            *common, s.temperature, s.top_p, s.seed, s.step, s.counts, s.counts.stride(0),
            *row_state, part_v, part_i, part_e, ticket, rc, rchunk,
            BLOCK=block, CP=pow2(rc), RACE=race, FAST=fast, num_warps=RACE_WARPS,
        )  # fmt: skip
    if filters:
        exact_kernel[(n,)](
            *common, s.temperature, s.top_p, s.seed, s.step, s.counts, s.counts.stride(0),
            *row_state, c, chunk, BLOCK=chunk, CP=cp, FAST=fast, num_warps=16,
        )  # fmt: skip
