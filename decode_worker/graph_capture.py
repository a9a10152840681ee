"""Capture of the decode step's CUDA graphs, and their release (GraphRunner's half that runs
once at start-up and at shutdown).

Capture (`capture`, once at start-up, before serving): every size is warmed up eagerly on a
side stream, then captured largest first into one shared memory pool; the KV that warm-up
wrote (padding lanes only ever touch block 0) is zeroed afterwards. `dispatch` (the one table
saying which graph serves a batch of n, 0 = eager) is built from the captured graphs alone.

A MASK variant (structured output) is two graphs per size: one forward, shared by the four
MASK sampling variants, whose logits those sampling graphs read; the host fills the token
masks between the two replays (graph_runner.py: `launch`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from splitserve.request.block_allocator import NULL_BLOCK

# graph variants, as flags: SAMPLE (any row not plain greedy), LOGPROBS (a row reports them),
# FILTER (a random row has top-k / top-p: the threshold searches run), MASK (a row is
# constrained: token masks applied first, token_masks.py); GREEDY is argmax only
GREEDY, SAMPLE, LOGPROBS, FILTER, MASK = 0, 1, 2, 4, 8
_PLAIN = (SAMPLE | LOGPROBS | FILTER, SAMPLE | FILTER, SAMPLE | LOGPROBS, SAMPLE)
VARIANTS = (*_PLAIN, GREEDY, *(v | MASK for v in _PLAIN))

log = logging.getLogger(__name__)


class GraphCapture:
    """Mixed into GraphRunner: uses its buffers, bodies and graph tables."""

    @torch.inference_mode()
    def capture(self, sizes: Sequence[int], warmup_steps: int = 2) -> None:
        """Warms up and captures `sizes` (CUDA only; a no-op elsewhere or with no sizes)."""
        if self.device.type != "cuda" or not sizes:
            return
        if self.runner.mirror is not None:
            self.runner.mirror(("capture", list(sizes), warmup_steps))
        self.release()
        sizes = sorted(set(sizes), reverse=True)
        if sizes[0] > self.max_batch_size:
            raise ValueError(f"graph size {sizes[0]} exceeds max_batch_size {self.max_batch_size}")
        with torch.cuda.device(self.device):
            self._capture(sizes, warmup_steps)
        self._build_dispatch()
        log.info("captured decode graphs for batch sizes %s", self.captured_sizes)

    def _capture(self, sizes: list[int], warmup_steps: int) -> None:
        self.bufs.reset()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile / autotune every shape before any capture
            for n in sizes:
                for variant in VARIANTS:
                    for _ in range(warmup_steps):
                        self._body(n, variant)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        for n in sizes:  # largest first: smaller graphs reuse its pool memory
            for variant in VARIANTS:
                graph = torch.cuda.CUDAGraph()
                if variant & MASK:  # two graphs: the host fills the masks between them
                    if n not in self._fwd_graphs:
                        self._fwd_graphs[n] = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(self._fwd_graphs[n], pool=self.pool):
                            self._fwd_logits[n] = self._forward(n)
                    with torch.cuda.graph(graph, pool=self.pool):
                        self._sample(n, variant, self._fwd_logits[n])
                    logits = self._fwd_logits[n]
                else:
                    with torch.cuda.graph(graph, pool=self.pool):
                        logits = self._body(n, variant)
                self._graphs[n, variant] = graph
                self._graph_logits[n, variant] = logits
        torch.cuda.synchronize(self.device)
        self.bufs.reset()
        self.sampling.reset()
        self.runner.kv_cache[:, :, NULL_BLOCK].zero_()  # the only block warm-up lanes wrote
        torch.cuda.synchronize(self.device)

    def _build_dispatch(self) -> None:
        sizes = self.captured_sizes
        self.dispatch = [
            next((s for s in sizes if s >= n), 0) for n in range(self.max_batch_size + 1)
        ]
        self.dispatch[0] = 0

    def release(self) -> None:
        """Drops every graph and the pool; idempotent (safe twice, from __del__, on SIGTERM)."""
        graphs = getattr(self, "_graphs", None)
        if not graphs and getattr(self, "pool", None) is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay may still run on the pool's memory
        if getattr(self.runner, "prefill_graphs", None) is not None:  # they share the pool
            self.runner.prefill_graphs.release()
        for g in [*graphs.values(), *self._fwd_graphs.values()]:
            g.reset()
        self._graphs, self._fwd_graphs, self._fwd_logits = {}, {}, {}
        self._graph_logits = {}
        self.pool = None
        self.dispatch = [0] * (self.max_batch_size + 1)
        self._rows = {}
        self.slots.clear()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass
