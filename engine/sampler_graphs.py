"""The host-facing sampler's step as CUDA graphs: a prompt's first token (prefill worker, a
decode worker's recompute and colocated prompts) sampled by one replay instead of ~15 Triton
launches from Python (measured on the H200 at one row: 1.0 ms eager, most of it launch cost,
against 0.07 ms for the argmax of a greedy row).

Static buffers, as the decode worker's graphs (decode_worker/graph_capture.py): a sampling
state of `max_rows` slots plus one frozen greedy slot for padding rows, an fp32 logits buffer,
the rows' slots and live flags, the tokens and the logprob outputs. A call of n rows runs at
the smallest captured row count b >= n (powers of two): its slots are filled (`write`, one
pinned copy per dtype), its logits copied in, rows n..b-1 point at the frozen slot with live 0
(nothing advances, no logprobs), and the graph of its variant is replayed:

    variant   FILTER (a random row has top-k / top-p)  x  LOGPROBS (a row reports them)

Token masks (structured output) and calls above `max_rows` keep the eager path (sampler.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from splitserve.engine.sampling_state import LogprobBuffers, RowInit, SamplingState, sample_step
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
        # row n of these: the slots / live flags of a call of n rows (one copy each per call)
        rows = torch.arange(max_rows, device=device)
        counts = torch.arange(max_rows + 1, device=device)[:, None]
        self._slots_of = torch.where(rows < counts, rows, max_rows)
        self._live_of = (rows < counts).to(i64)
        self.sizes = row_buckets(max_rows)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None

    def bucket(self, n: int) -> int:
        return next((b for b in self.sizes if b >= n), 0)

    def _body(self, b: int, variant: int) -> None:
        lp = self.lp if variant & LOGPROBS else None
        sample_step(
            self.x[:b], self.slots[:b], self.live[:b], self.state, self.out, lp, variant & FILTER
        )

    @torch.inference_mode()
    def capture(self, warmup_steps: int = 2) -> None:
        """Every row count and variant: warmed on a side stream (compiles every kernel), then
        captured largest first into one pool. Padding rows only: the state stays as it was."""
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
            self.pool = torch.cuda.graph_pool_handle()
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
        self.state.write(list(range(n)), rows, eos)
        self.x[:n].copy_(logits)
        self.slots.copy_(self._slots_of[n])
        self.live.copy_(self._live_of[n])
        self._graphs[b, (FILTER if filters else 0) | (LOGPROBS if logprobs else 0)].replay()
        return self.out[:n], self.lp if logprobs else None
