"""The host-facing sampler's step as CUDA graphs: a prompt's first token (prefill worker, a
decode worker's recompute and colocated prompts) sampled by one replay instead of ~15 Triton
launches from Python (measured on the H200 at one row: 1.0 ms eager, most of it launch cost,
against 0.07 ms for the argmax of a greedy row).

Static buffers, as the decode worker's graphs (decode_worker/graph_capture.py): a sampling
state of `max_rows` slots plus one frozen greedy slot for padding rows, an fp32 logits buffer,
the rows' slots and live flags, the tokens and the logprob outputs, and staging buffers for the
slots' fields. A call of n rows runs at the smallest captured row count b >= n (powers of
two): the rows' fields are packed into pinned staging (rows n..b-1 point at the frozen slot
with live 0: nothing advances, no logprobs) and copied up in four copies, its logits copied
in, and the graph of its variant is replayed; it moves the staged fields into slots 0..b-1
(one eager `write` cost ~0.4 ms of launches) and samples. Penalty state (counts and prompt
mask) is written eagerly, only for calls that have a penalised row.

    variant   FILTER (a random row has top-k / top-p)  x  LOGPROBS (a row reports them)

Token masks (structured output) and calls above `max_rows` keep the eager path (sampler.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from splitserve.engine.sampling_state import (
    FLOAT_FIELDS,
    GREEDY_FLOATS,
    INT_FIELDS,
    LogprobBuffers,
    RowInit,
    SamplingState,
    bias_rows,
    sample_step,
    scalar_rows,
)
from splitserve.request.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

FILTER, LOGPROBS = 1, 2
VARIANTS = (0, FILTER, LOGPROBS, FILTER | LOGPROBS)
GRAPH_ROWS = 32  # rows of the largest graph (first tokens finishing in one prefill step)

log = logging.getLogger(__name__)


def row_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to `max_rows` (itself included)."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return [*out, max_rows]


class SamplerGraphs:
    def __init__(
        self, vocab: int, device: torch.device, num_eos: int, max_rows: int = GRAPH_ROWS
    ) -> None:
        self.vocab, self.device, self.max_rows = vocab, device, max_rows
        i64 = torch.int64
        self.state = SamplingState(
            max_rows + 1, vocab, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS + num_eos, device
        )
        self.state.frozen_slot = max_rows  # padding rows: plain greedy, never advanced
        self.x = torch.zeros(max_rows, vocab, dtype=torch.float32, device=device)
        self.slots = torch.full((max_rows,), max_rows, dtype=i64, device=device)
        self.live = torch.zeros(max_rows, dtype=i64, device=device)
        self.out = torch.zeros(max_rows, dtype=i64, device=device)
        self.lp = LogprobBuffers.empty(max_rows, vocab, device)
        # staged slot fields, filled from pinned twins by one copy each; the graph moves them
        # into the state (rows: the float fields; the int fields, the rows' slots, live flags)
        st = self.state
        self._bias_w, ban_w = st.bias_ids.shape[1], st.ban_ids.shape[1]
        shapes = (
            ((len(FLOAT_FIELDS), max_rows), torch.float32),
            ((len(INT_FIELDS) + 2, max_rows), i64),
            ((max_rows, self._bias_w + ban_w), torch.int32),
            ((max_rows, self._bias_w), torch.float32),
        )
        self._stage = [torch.zeros(shape, dtype=dt, device=device) for shape, dt in shapes]
        self._host = [torch.zeros(shape, dtype=dt).pin_memory() for shape, dt in shapes]
        self._stage_rows((), (), 0, max_rows)  # all padding: what capture runs on
        self.sizes = row_buckets(max_rows)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None

    def bucket(self, n: int) -> int:
        return next((b for b in self.sizes if b >= n), 0)

    def _body(self, b: int, variant: int) -> None:
        st, (f, i, ids, vals) = self.state, self._stage
        for k, name in enumerate(FLOAT_FIELDS):
            getattr(st, name)[:b].copy_(f[k, :b])
        for k, name in enumerate(INT_FIELDS):
            getattr(st, name)[:b].copy_(i[k, :b])
        self.slots[:b].copy_(i[-2, :b])
        self.live[:b].copy_(i[-1, :b])
        st.bias_ids[:b].copy_(ids[:b, : self._bias_w])
        st.ban_ids[:b].copy_(ids[:b, self._bias_w :])
        st.bias_vals[:b].copy_(vals[:b])
        lp = self.lp if variant & LOGPROBS else None
        sample_step(
            self.x[:b], self.slots[:b], self.live[:b], self.state, self.out, lp, variant & FILTER
        )

    @torch.inference_mode()
    def capture(self, pool=None, warmup_steps: int = 2) -> None:
        """Every row count and variant: warmed on a side stream (compiles every kernel), then
        captured largest first into `pool` (the worker's other graphs' pool; a new one when
        None). Padding rows only: the state stays as it was."""
        dev = self.device
        with torch.cuda.device(dev):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for b in self.sizes:
                    for variant in VARIANTS:
                        for _ in range(warmup_steps):
                            self._body(b, variant)
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
            for b in reversed(self.sizes):
                for variant in VARIANTS:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        self._body(b, variant)
                    self._graphs[b, variant] = graph
            torch.cuda.synchronize(dev)
        log.info("captured first-token sampling graphs for %s rows", self.sizes)

    def release(self) -> None:
        if self._graphs:
            torch.cuda.synchronize(self.device)
        for g in self._graphs.values():
            g.reset()
        self._graphs.clear()
        self.pool = None

    def serves(self, n: int, vocab: int) -> bool:
        return bool(self._graphs) and 0 < n <= self.max_rows and vocab == self.vocab

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[RowInit],
        eos: Sequence[int],
        logprobs: bool,
        filters: bool,
    ) -> tuple[torch.Tensor, LogprobBuffers | None]:
        """Tokens [n] (device) and, with `logprobs`, the buffers holding rows 0..n-1's."""
        n = logits.shape[0]
        b = self.bucket(n)
        self._stage_rows(rows, eos, n, b)
        if any(r.params.needs_penalties for r in rows):  # counts and prompt mask: eager
            self.state.counts[:n].zero_()
            self.state.prompt_seen[:n].zero_()
            self.state.write_penalty_tokens(range(n), rows)
        self.x[:n].copy_(logits)
        self._graphs[b, (FILTER if filters else 0) | (LOGPROBS if logprobs else 0)].replay()
        return self.out[:n], self.lp if logprobs else None

    def _stage_rows(self, rows: Sequence[RowInit], eos: Sequence[int], n: int, b: int) -> None:
        """Rows 0..n-1 into the pinned staging, rows n..b-1 as padding (the frozen greedy
        slot, not live), then one copy per buffer (the last call's copies are done: its tokens
        were read)."""
        f, i, ids, vals = self._host
        floats, ints = scalar_rows(rows, self.vocab)
        pad = b - n
        f[:, :b] = torch.tensor([col + [g] * pad for col, g in zip(floats, GREEDY_FLOATS)])
        slots = [*range(n), *[self.max_rows] * pad]
        i[:, :b] = torch.tensor([*(col + [0] * pad for col in ints), slots, [1] * n + [0] * pad])
        lists = bias_rows([r.params for r in rows], eos, self._bias_w, ids.shape[1] - self._bias_w)
        ids[:b, : self._bias_w] = 0
        ids[:b, self._bias_w :] = -1
        vals[:b] = 0.0
        if lists is not None:
            ids[:n] = torch.tensor(lists[0], dtype=torch.int32)
            vals[:n] = torch.tensor(lists[1], dtype=torch.float32)
        for dst, src in zip(self._stage, self._host):
            dst.copy_(src, non_blocking=True)
