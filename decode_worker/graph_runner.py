"""The decode step: CUDA-graph replay of a captured batch size, or the same code eagerly.

One step of n real lanes (`launch`):

    host: prepare (batch changed)  ─ pinned slot ─H2D─▶ tables, positions, live, first tokens
          or patch (steady)        ─ pinned slot ─H2D─▶ only the blocks appended this step
    device, one graph replay of the padded size N = dispatch[n] (or the eager body):
          slot_mapping, context_lens  <- positions, block_tables, live     (derive_metadata)
          logits = model.logits(input_ids, positions, ...)   sampled = argmax(logits)
          input_ids <- sampled; positions += live                          (advance)
    device ─D2H─▶ pinned slot: sampled[:n]; event recorded   (read later, in `read`)

So in the steady loop (same rows as the last step, greedy) the host issues one graph launch,
one D2H copy and one event record per step (+ one small copy and one kernel when a sequence
crosses a block boundary); the previous step's token is fed from the device, never read
back first. Padding lanes sit on the null block: position 0, context_len 0, slot 0 of block 0.

Capture (`capture`, once at start-up, before serving): every size is warmed up eagerly on a
side stream, then captured largest first into one shared memory pool; the KV that warm-up
wrote (padding lanes only ever touch block 0) is zeroed afterwards. `dispatch` (the one table
saying which graph serves a batch of n, 0 = eager) is built from the captured graphs alone.

Tensor parallel: rank 0 publishes (`runner.mirror`) each step's device-side work, i.e. the
padded size, the graph to replay and the prepare / patch data, and every host-sampled token
write and capture; followers (tp_follower.py) apply the same to their own buffers with
`run_step`, so every rank replays the same graph with the same padding. The sampled tokens
are broadcast from rank 0 inside the step (captured with NCCL), so all ranks feed rank 0's
choice to the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from splitserve.decode_worker.sequence import DecodeSequence
from splitserve.decode_worker.step_buffers import DecodeBuffers, StagingSlot
from splitserve.engine.attention_metadata import AttentionMetadata
from splitserve.engine.model_runner import ModelRunner
from splitserve.request.block_allocator import NULL_BLOCK

log = logging.getLogger(__name__)


@dataclass
class StepHandle:
    """A launched step; `GraphRunner.read` gives its tokens."""

    seqs: list[DecodeSequence]
    slot: StagingSlot
    graph_size: int  # 0: eager
    sampler_rows: list[int] = field(default_factory=list)
    sampler_logits: torch.Tensor | None = (
        None  # [len(sampler_rows), V], cloned right after the step
    )

    @property
    def needs_host_sampling(self) -> bool:
        return bool(self.sampler_rows)


class GraphRunner:
    def __init__(self, runner: ModelRunner, max_batch_size: int) -> None:
        self.runner = runner
        self.device = runner.device
        self.max_batch_size = max_batch_size
        self.bufs = DecodeBuffers(
            max_batch_size, runner.max_blocks_per_seq, runner.block_size, runner.device
        )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_logits: dict[int, torch.Tensor] = {}
        self._pool = None
        self.dispatch: list[int] = [0] * (max_batch_size + 1)
        self._rows: dict[int, int] = {}  # seq.uid -> row in the last launched step
        self.num_replays = 0
        self.num_eager = 0

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    # ---- the step body (captured, or run eagerly) --------------------------------------------
    def _body(self, n: int) -> torch.Tensor:
        b, r = self.bufs, self.runner
        b.derive_metadata(n)
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping[:n],
            block_tables=b.block_tables[:n],
            context_lens=b.context_lens[:n],
            is_prefill=False,
        )
        logits = r.model.logits(b.input_ids[:n], b.positions[:n], r.kv_cache, r.cos_sin, meta)
        b.sampled[:n].copy_(logits.argmax(dim=-1))
        r.tp.broadcast_(b.sampled[:n])  # rank 0's choice everywhere (a no-op without TP)
        b.advance(n)
        return logits

    # ---- capture -------------------------------------------------------------------------------
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
                for _ in range(warmup_steps):
                    self._body(n)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        for n in sizes:  # largest first: smaller graphs reuse its pool memory
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._body(n)
            self._graphs[n] = graph
            self._graph_logits[n] = logits
        torch.cuda.synchronize(self.device)
        self.bufs.reset()
        self.runner.kv_cache[:, :, NULL_BLOCK].zero_()  # the only block warm-up lanes wrote
        torch.cuda.synchronize(self.device)

    def _build_dispatch(self) -> None:
        sizes = sorted(self._graphs)
        self.dispatch = [
            next((s for s in sizes if s >= n), 0) for n in range(self.max_batch_size + 1)
        ]
        self.dispatch[0] = 0

    def release(self) -> None:
        """Drops every graph and the pool; idempotent (safe twice, from __del__, on SIGTERM)."""
        graphs = getattr(self, "_graphs", None)
        if not graphs and getattr(self, "_pool", None) is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay may still run on the pool's memory
        for g in graphs.values():
            g.reset()
        self._graphs = {}
        self._graph_logits = {}
        self._pool = None
        self.dispatch = [0] * (self.max_batch_size + 1)
        self._rows = {}

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(
        self,
        seqs: Sequence[DecodeSequence],
        changed: bool,
        new_blocks: Sequence[tuple[DecodeSequence, int, int]] = (),
    ) -> StepHandle:
        """Enqueues one decode step for `seqs` (their KV up to next_position present, their
        blocks allocated); returns at once (on CUDA) with a handle for `read`."""
        n = len(seqs)
        if not 0 < n <= self.max_batch_size:
            raise ValueError(f"batch of {n} outside 1..{self.max_batch_size}")
        graph_size = self.dispatch[n]
        size = graph_size or n
        prep = None
        if changed or not self._rows:
            lost = [s.request_id for s in seqs if s.in_flight and s.uid not in self._rows]
            if lost:  # its next token exists only on the device, in a row we no longer know
                raise RuntimeError(
                    f"sequences {lost} have a token in flight but were not in the last step"
                )
            prep = (
                "prepare",
                size,
                [list(s.block_ids) for s in seqs],
                [s.next_position for s in seqs],
                [s.output_token_ids[-1] if s.in_flight == 0 else 0 for s in seqs],
                [self._rows.get(s.uid, -1) if s.in_flight else -1 for s in seqs],
            )
            self._rows = {s.uid: i for i, s in enumerate(seqs)}
        elif new_blocks:
            prep = ("patch", [(self._rows[s.uid], col, blk) for s, col, blk in new_blocks])
        if self.runner.mirror is not None:
            self.runner.mirror(("graph_step", n, graph_size, prep))
        slot = self.bufs.ring.acquire()
        logits = self.run_step(slot, n, graph_size, prep)
        handle = StepHandle(list(seqs), slot, graph_size)
        handle.sampler_rows = [i for i, s in enumerate(seqs) if s.uses_sampler]
        if handle.sampler_rows:  # clone before the next replay overwrites the graph's output
            idx = torch.tensor(handle.sampler_rows, device=self.device)
            handle.sampler_logits = logits.index_select(0, idx)
        slot.out[:n].copy_(self.bufs.sampled[:n], non_blocking=True)
        slot.record()
        for s in seqs:
            s.in_flight += 1
        return handle

    @torch.inference_mode()
    def run_step(
        self, slot: StagingSlot, n: int, graph_size: int, prep: tuple | None
    ) -> torch.Tensor:
        """The device side of one step: fill the inputs (`prep`: a full prepare, a table patch or
        nothing), then replay graph `graph_size` (0: eager body). Followers call it directly."""
        if prep is not None and prep[0] == "prepare":
            self.bufs.prepare(slot, *prep[1:])
        elif prep is not None:
            self.bufs.patch_tables(slot, prep[1])
        if graph_size:
            self._graphs[graph_size].replay()
            self.num_replays += 1
            return self._graph_logits[graph_size]
        self.num_eager += 1
        return self._body(n)

    def read(self, handle: StepHandle) -> list[int]:
        """The step's argmax tokens, row order (waits for the step to finish)."""
        handle.slot.wait()
        return handle.slot.out_np[: len(handle.seqs)].tolist()

    @torch.inference_mode()
    def write_tokens(self, handle: StepHandle, tokens: Sequence[int]) -> None:
        """Host-sampled tokens of `handle.sampler_rows` become those rows' next inputs."""
        if self.runner.mirror is not None:
            self.runner.mirror(("write_tokens", list(handle.sampler_rows), list(tokens)))
        self.bufs.write_tokens(handle.sampler_rows, tokens)
