"""The decode step: CUDA-graph replay of a captured batch size, or the same code eagerly.

One step of n real lanes (`launch`):

    host: prepare (batch changed)  ─ pinned slot ─H2D─▶ tables, positions, live, first tokens
          or patch (steady)        ─ pinned slot ─H2D─▶ only the blocks appended this step
    device, one graph replay of the padded size N = dispatch[n] (or the eager body):
          slot_mapping, context_lens  <- positions, block_tables, live     (derive_metadata)
          logits = model.logits(input_ids, positions, ...)
          sampled = argmax(logits)                                  (GREEDY graphs)
                 or sample_step(logits, slots, ...)                 (SAMPLE / LOGPROBS graphs)
          input_ids <- sampled; positions += live                          (advance)
    device ─D2H─▶ pinned slot: sampled[:n] (+ logprobs); event recorded   (read later, `read`)

Sampling is part of the step (engine/sampling_state.py): every row reads its parameters from a
state slot on the device, filled once when its sequence first runs (sampling_slots.py), so one
replay serves any mix of greedy, random, seeded, penalised and logprobs rows and the host only
reads tokens back. A batch of plain greedy rows replays the GREEDY graph (argmax only); other
rows pick a variant by flags (SAMPLE, + LOGPROBS, + FILTER, + MASK: see VARIANTS); each captured
size has all nine (the four MASK ones share one forward graph). The forward (`model.logits`) and
the sampling (`sample_step`) are separate calls in `_body`, so rows whose token mask the host
computes from the previous token (structured output) can get a variant whose sampling is a
second graph replayed after that mask is copied in, without touching the forward.

So in the steady loop (same rows as the last step, greedy) the host issues one graph launch,
one D2H copy and one event record per step (+ one small copy and one kernel when a sequence
crosses a block boundary); the previous step's token is fed from the device, never read
back first. Padding lanes sit on the null block: position 0, context_len 0, slot 0 of block 0.

Capture and release: graph_capture.py.

Tensor parallel: rank 0 publishes (`runner.mirror`) each step's device-side work, i.e. the
padded size, the graph (and variant) to replay, the prepare / patch data, slot fills and
capture; followers (tp_follower.py) apply the same to their own buffers with
`run_step`, so every rank replays the same graph with the same padding. The sampled tokens
are broadcast from rank 0 inside the step (captured with NCCL), so all ranks feed rank 0's
choice to the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitserve.decode_worker.graph_capture import (  # noqa: F401 (the variants, re-exported)
    FILTER,
    GREEDY,
    LOGPROBS,
    MASK,
    SAMPLE,
    VARIANTS,
    GraphCapture,
)
from splitserve.decode_worker.sampling_slots import SamplingSlots
from splitserve.decode_worker.sequence import DecodeSequence
from splitserve.decode_worker.step_buffers import DecodeBuffers, StagingSlot
from splitserve.decode_worker.token_masks import TokenMasks
from splitserve.engine.attention_metadata import AttentionMetadata
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.sampler import Sampler, TokenLogprobs, to_token_logprobs
from splitserve.engine.sampling_state import (
    LogprobBuffers,
    RowInit,
    has_filters,
    sample_step,
)
from splitserve.request.sampling_params import MAX_LOGPROBS


@dataclass
class StepHandle:
    """A launched step; `GraphRunner.read` gives its tokens."""

    seqs: list[DecodeSequence]
    slot: StagingSlot
    graph_size: int  # 0: eager
    variant: int = GREEDY


class GraphRunner(GraphCapture):
    def __init__(
        self, runner: ModelRunner, max_batch_size: int, sampler: Sampler | None = None
    ) -> None:
        self.runner = runner
        self.device = runner.device
        self.max_batch_size = max_batch_size
        mc = runner.model_config
        eos = tuple(mc.eos_token_ids)
        self.sampler = sampler or Sampler(None, eos)
        lp_width = min(MAX_LOGPROBS, mc.vocab_size)
        self.slots = SamplingSlots(
            max_batch_size, mc.vocab_size, eos, runner.device, self.sampler, runner
        )
        self.sampling = self.slots.state
        self.variant_steps = [0] * 16  # steps launched per variant (flags), for tests and metrics
        self.masks = TokenMasks(max_batch_size, mc.vocab_size, runner.device)
        self.bufs = DecodeBuffers(
            max_batch_size,
            runner.max_blocks_per_seq,
            runner.block_size,
            runner.device,
            greedy_slot=self.slots.greedy_slot,
            lp_width=lp_width,
        )
        self._lp_pack = torch.zeros(max_batch_size, 1 + lp_width, device=runner.device)
        self._lp_ids = torch.zeros(
            max_batch_size, lp_width, dtype=torch.int64, device=runner.device
        )
        self._lp = LogprobBuffers(self._lp_pack[:, 0], self._lp_pack[:, 1:], self._lp_ids)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._graph_logits: dict[tuple[int, int], torch.Tensor] = {}
        self._fwd_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # MASK variants' forward halves
        self._fwd_logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.dispatch: list[int] = [0] * (max_batch_size + 1)
        self._rows: dict[int, int] = {}  # seq.uid -> row in the last launched step
        self.num_replays = 0
        self.num_eager = 0

    @property
    def captured_sizes(self) -> list[int]:
        return sorted({size for size, _ in self._graphs})

    # ---- the step body (captured, or run eagerly) --------------------------------------------
    def _body(self, n: int, variant: int = GREEDY) -> torch.Tensor:
        logits = self._forward(n)
        self._sample(n, variant, logits)
        return logits

    def _forward(self, n: int) -> torch.Tensor:
        b, r = self.bufs, self.runner
        b.derive_metadata(n)
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping[:n],
            block_tables=b.block_tables[:n],
            context_lens=b.context_lens[:n],
            is_prefill=False,
        )
        return r.model.logits(b.input_ids[:n], b.positions[:n], r.kv_cache, r.cos_sin, meta)

    def _sample(self, n: int, variant: int, logits: torch.Tensor) -> None:
        b, r = self.bufs, self.runner
        if variant == GREEDY:
            b.sampled[:n].copy_(logits.argmax(dim=-1))
        else:
            lp = self._lp if variant & LOGPROBS else None
            filters, masks = bool(variant & FILTER), self.masks.device if variant & MASK else None
            sample_step(
                logits, b.slots[:n], b.live[:n], self.sampling, b.sampled, lp, filters, masks
            )
        r.tp.broadcast_(b.sampled[:n])  # rank 0's choice everywhere (a no-op without TP)
        b.advance(n)

    @torch.inference_mode()
    def write_slots(self, slots: list[int], rows: list[RowInit]) -> None:
        """A follower's side of rank 0's slot fills."""
        self.slots.write(slots, rows)

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(
        self,
        seqs: Sequence[DecodeSequence],
        changed: bool,
        new_blocks: Sequence[tuple[DecodeSequence, int, int]] = (),
        before_masks: Callable[[Callable[..., None]], None] | None = None,
    ) -> StepHandle:
        """Enqueues one decode step for `seqs` (their KV up to next_position present, their
        blocks allocated); returns at once (on CUDA) with a handle for `read`. A batch with a
        constrained row enqueues the forward, calls `before_masks` (the engine reads the
        previous step's constrained rows there: the matchers need their tokens; then it calls
        the hook it is given, which fills the masks, running the work it is passed, if any, on
        a helper thread beside the fill; the engine reads the other rows then or after this
        returns)
        while the forward runs, then copies the masks and enqueues the sampling."""
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
                self.slots.assign(seqs),
            )
            self._rows = {s.uid: i for i, s in enumerate(seqs)}
        elif new_blocks:
            prep = ("patch", [(self._rows[s.uid], col, blk) for s, col, blk in new_blocks])
        variant = GREEDY
        if any(not s.params.is_plain_greedy for s in seqs):
            variant = SAMPLE
            variant |= LOGPROBS if any(s.params.logprobs is not None for s in seqs) else 0
            variant |= FILTER if any(has_filters(s.params) for s in seqs) else 0
        if TokenMasks.constrained(seqs):  # (a constrained row is never plain greedy)
            variant |= MASK
        if self.runner.mirror is not None:
            self.runner.mirror(("graph_step", n, graph_size, prep, variant))
        slot = self.bufs.ring.acquire()
        self.variant_steps[variant] += 1
        if variant & MASK:
            logits = self.run_forward(slot, n, graph_size, prep)
            if before_masks is not None:  # the fill starts once the constrained rows are read
                before_masks(lambda beside=None: self.masks.start(seqs, beside))
            self.masks.finish(seqs)
            self.run_sample(n, graph_size, variant, logits)
        else:
            self.run_step(slot, n, graph_size, prep, variant)
        slot.out[:n].copy_(self.bufs.sampled[:n], non_blocking=True)
        if variant & LOGPROBS:
            slot.lp[:n].copy_(self._lp_pack[:n], non_blocking=True)
            slot.lp_ids[:n].copy_(self._lp_ids[:n], non_blocking=True)
        slot.record()
        for s in seqs:
            s.in_flight += 1
        return StepHandle(list(seqs), slot, graph_size, variant)

    @torch.inference_mode()
    def run_step(
        self, slot: StagingSlot, n: int, graph_size: int, prep: tuple | None, variant: int
    ) -> torch.Tensor:
        """The device side of one step: fill the inputs (`prep`: a full prepare, a table patch or
        nothing), then replay graph (`graph_size`, `variant`) (size 0: the eager body).
        Followers call it directly (a MASK variant: both halves back to back)."""
        if variant & MASK:
            logits = self.run_forward(slot, n, graph_size, prep)
            self.run_sample(n, graph_size, variant, logits)
            return logits
        self._fill(slot, prep)
        if graph_size:
            self._graphs[graph_size, variant].replay()
            self.num_replays += 1
            return self._graph_logits[graph_size, variant]
        self.num_eager += 1
        return self._body(n, variant)

    def _fill(self, slot: StagingSlot, prep: tuple | None) -> None:
        if prep is not None and prep[0] == "prepare":
            self.bufs.prepare(slot, *prep[1:])
        elif prep is not None:
            self.bufs.patch_tables(slot, prep[1])

    def run_forward(
        self, slot: StagingSlot, n: int, graph_size: int, prep: tuple | None
    ) -> torch.Tensor:
        """A MASK step's first half: inputs, then the forward (its graph, or eagerly)."""
        self._fill(slot, prep)
        if graph_size:
            self._fwd_graphs[graph_size].replay()
            return self._fwd_logits[graph_size]
        return self._forward(n)

    def run_sample(self, n: int, graph_size: int, variant: int, logits: torch.Tensor) -> None:
        """A MASK step's second half, once the masks are in: sampling, broadcast, advance."""
        if graph_size:
            self._graphs[graph_size, variant].replay()
            self.num_replays += 1
        else:
            self._sample(n, variant, logits)
            self.num_eager += 1

    def read(self, handle: StepHandle) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The step's tokens in row order, and each row's logprobs where its request asks
        (waits for the step to finish)."""
        handle.slot.wait()
        n = len(handle.seqs)
        tokens = handle.slot.out_np[:n].tolist()
        if not handle.variant & LOGPROBS:
            return tokens, [None] * n
        lp = handle.slot.lp[:n]
        host = LogprobBuffers(lp[:, 0], lp[:, 1:], handle.slot.lp_ids[:n])
        return tokens, to_token_logprobs(tokens, host, [s.params for s in handle.seqs])
