"""Which sampling-state slot each running sequence owns (engine/sampling_state.py).

Slots 0..max_bs-1 go to sequences that are not plain greedy, the first time they run; slot
max_bs stays plain greedy (greedy rows, padding lanes) and the step never advances it. A
sequence is in every decode step until it finishes or is preempted, so a sequence missing
from a changed batch gives its slot back; a preempted one gets a slot again when it returns,
filled from its tokens so far. Fills are stream-ordered after the step in flight, which may
still read the slot's previous owner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.decode_worker.sequence import DecodeSequence
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.sampler import Sampler
from splitserve.engine.sampling_state import RowInit, SamplingState
from splitserve.request.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS


class SamplingSlots:
    def __init__(
        self,
        max_batch_size: int,
        vocab: int,
        eos: Sequence[int],
        device: torch.device,
        sampler: Sampler,
        runner: ModelRunner,
    ) -> None:
        self.state = SamplingState(
            max_batch_size + 1, vocab, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS + len(eos), device
        )
        self.greedy_slot = max_batch_size
        self.state.frozen_slot = max_batch_size
        self._eos = tuple(eos)
        self._sampler = sampler
        self._runner = runner  # its `mirror` (set on rank 0 of a TP worker) may come later
        self.clear()

    def clear(self) -> None:
        self.free = list(range(self.greedy_slot - 1, -1, -1))
        self.owner: dict[int, int] = {}  # seq.uid -> slot

    def assign(self, seqs: Sequence[DecodeSequence]) -> list[int]:
        """The slot of each row of a changed batch (filling the new ones)."""
        here = {s.uid for s in seqs}
        for uid in [u for u in self.owner if u not in here]:
            self.free.append(self.owner.pop(uid))
        new_slots, rows = [], []
        for s in seqs:
            if s.params.is_plain_greedy or s.uid in self.owner:
                continue
            slot = self.owner[s.uid] = self.free.pop()
            step = len(s.output_token_ids) + s.in_flight
            # copies: the sequence's lists keep growing after this call
            prompt, out = list(s.prompt_token_ids), list(s.output_token_ids)
            new_slots.append(slot)
            rows.append(RowInit(s.params, prompt, out, self._sampler.seed_for(s.params), step))
        if new_slots:
            self.write(new_slots, rows)
        return [self.owner.get(s.uid, self.greedy_slot) for s in seqs]

    @torch.inference_mode()
    def write(self, slots: list[int], rows: list[RowInit]) -> None:
        """Fills `slots` (rank 0 publishes it: followers call this too)."""
        if self._runner.mirror is not None:
            self._runner.mirror(("write_slots", slots, rows))
        self.state.write(slots, rows, self._eos)
