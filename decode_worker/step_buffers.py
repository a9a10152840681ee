"""Static device inputs of the decode step, and the pinned host staging that fills them.

Device buffers (sized to the max batch; a step of n lanes uses rows [:n]; graphs read them):

    input_ids    [max_bs] int64   token fed this step   (the step itself writes the next one)
    positions    [max_bs] int64   position fed          (the step itself adds `live`)
    live         [max_bs] int64   1 real lane, 0 padding lane
    block_tables [max_bs, MB] int32   columns past a row's last block may be stale: they are
                                      never read (attention reads ceil(context_len / BS) blocks)
    context_lens [max_bs] int32   derived on the device each step: (positions + 1) * live
    slot_mapping [max_bs] int64   derived on the device: block_tables[pos // BS] * BS + pos % BS
    sampled      [max_bs] int64   this step's tokens (argmax, or sampled on the device)
    slots        [max_bs] int64   the sampling-state slot of each row (engine/sampling_state.py;
                                  the greedy slot for plain greedy rows and padding lanes)

Host -> device traffic goes through a ring of pinned staging slots (plain tensors on CPU).
A slot is reused only after the event recorded behind its last copy has completed, so a
non-blocking copy never reads a buffer the host is already rewriting. One step uses one
slot: its packed input (one H2D copy) and its sampled-token output (one D2H copy, plus two
for the logprobs of a step that reports them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

PAD_TOKEN = 0


@dataclass
class StagingSlot:
    inp: torch.Tensor  # int32, packed step input
    out: torch.Tensor  # int64, sampled tokens of the step
    event: torch.cuda.Event | None
    inp_np: np.ndarray
    out_np: np.ndarray
    lp: torch.Tensor  # float32 [max_bs, 1 + W]: sampled token's logprob, then the top W
    lp_ids: torch.Tensor  # int64 [max_bs, W]: ids of the top W

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def record(self) -> None:
        if self.event is not None:
            self.event.record()


class StagingRing:
    def __init__(
        self, num_slots: int, inp_len: int, out_len: int, lp_width: int, device: torch.device
    ) -> None:
        pin = device.type == "cuda"
        self._slots = []
        for _ in range(num_slots):
            inp = torch.zeros(inp_len, dtype=torch.int32, pin_memory=pin)
            out = torch.zeros(out_len, dtype=torch.int64, pin_memory=pin)
            lp = torch.zeros(out_len, 1 + lp_width, dtype=torch.float32, pin_memory=pin)
            lp_ids = torch.zeros(out_len, lp_width, dtype=torch.int64, pin_memory=pin)
            event = torch.cuda.Event() if pin else None
            self._slots.append(StagingSlot(inp, out, event, inp.numpy(), out.numpy(), lp, lp_ids))
        self._next = 0

    def acquire(self) -> StagingSlot:
        """The next slot, once every copy issued from or into it has finished."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        slot.wait()
        return slot


class DecodeBuffers:
    def __init__(
        self,
        max_bs: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        greedy_slot: int,
        lp_width: int,
    ) -> None:
        self.max_bs, self.max_blocks, self.block_size, self.device = (
            max_bs,
            max_blocks,
            block_size,
            device,
        )
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(max_bs, dtype=i64, device=device)
        self.positions = torch.zeros(max_bs, dtype=i64, device=device)
        self.live = torch.zeros(max_bs, dtype=i64, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=i32, device=device)
        self.context_lens = torch.zeros(max_bs, dtype=i32, device=device)
        self.slot_mapping = torch.zeros(max_bs, dtype=i64, device=device)
        self.sampled = torch.zeros(max_bs, dtype=i64, device=device)
        self.greedy_slot = greedy_slot
        self.slots = torch.full((max_bs,), greedy_slot, dtype=i64, device=device)
        # device landing zone of the packed staging input: [tables n*w | pos | live | ids | src |
        # slots]
        self.scratch = torch.zeros(max_bs * (max_blocks + 5), dtype=i32, device=device)
        self.ring = StagingRing(3, self.scratch.numel(), max_bs, lp_width, device)

    def reset(self) -> None:
        """Every lane a padding lane on the null block (what warm-up and capture run on)."""
        for t in (
            self.input_ids,
            self.positions,
            self.live,
            self.block_tables,
            self.context_lens,
            self.slot_mapping,
            self.sampled,
        ):
            t.zero_()
        self.slots.fill_(self.greedy_slot)

    # ---- per-step metadata, on the device (captured inside the graphs) -----------------------
    def derive_metadata(self, n: int) -> None:
        pos, live = self.positions[:n], self.live[:n]
        blk = self.block_tables[:n].gather(
            1, torch.div(pos, self.block_size, rounding_mode="floor").unsqueeze(1)
        )
        self.slot_mapping[:n].copy_(
            blk.squeeze(1).to(torch.int64) * self.block_size + pos % self.block_size
        )
        self.context_lens[:n].copy_((pos + 1) * live)

    def advance(self, n: int) -> None:
        """The steady path: the sampled token becomes the next input, real lanes move one on."""
        self.input_ids[:n].copy_(self.sampled[:n])
        self.positions[:n].add_(self.live[:n])

    # ---- host -> device ------------------------------------------------------------------------
    def prepare(
        self,
        slot: StagingSlot,
        n: int,
        tables: Sequence[Sequence[int]],
        positions: Sequence[int],
        host_ids: Sequence[int],
        src_rows: Sequence[int],
        slots: Sequence[int],
    ) -> None:
        """Full prepare of rows [:n] for len(tables) real lanes (the rest padding). A lane with
        src_rows[i] >= 0 continues from row src_rows[i] of the previous step and takes its next
        token from the device; otherwise host_ids[i] is fed (a handed-off first token). Row i
        samples with state slot slots[i]."""
        m = len(tables)
        w = max(1, max((len(t) for t in tables), default=1))
        a = slot.inp_np
        bt = a[: n * w].reshape(n, w)
        bt[:] = 0
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        o = n * w
        # padding: position 0, not live, token 0, no source, the greedy slot
        pads = (PAD_TOKEN, 0, PAD_TOKEN, -1, self.greedy_slot)
        for j, vals in enumerate((positions, [1] * m, host_ids, src_rows, slots)):
            seg = a[o + j * n : o + (j + 1) * n]
            seg[:m] = vals
            seg[m:] = pads[j]
        total = o + 5 * n
        dev = self.scratch[:total]
        dev.copy_(slot.inp[:total], non_blocking=True)
        self.block_tables[:n, :w].copy_(dev[: n * w].view(n, w))
        pos, live, ids, src, slots_dev = dev[o:].view(5, n).unbind(0)
        self.positions[:n].copy_(pos)
        self.live[:n].copy_(live)
        self.slots[:n].copy_(slots_dev)
        carried = self.input_ids.index_select(0, src.clamp(min=0).to(torch.int64))
        self.input_ids[:n].copy_(torch.where(src >= 0, carried, ids.to(torch.int64)))

    def patch_tables(self, slot: StagingSlot, cells: Sequence[tuple[int, int, int]]) -> None:
        """Steady path: new blocks (row, column, block) written in place, one small copy."""
        k = len(cells)
        a = slot.inp_np
        for i, (row, col, block) in enumerate(cells):
            a[i] = row * self.max_blocks + col
            a[k + i] = block
        dev = self.scratch[: 2 * k]
        dev.copy_(slot.inp[: 2 * k], non_blocking=True)
        self.block_tables.view(-1).index_copy_(0, dev[:k].to(torch.int64), dev[k:])
