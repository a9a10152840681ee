"""Static inputs of the fused prefill pieces (engine/prefill_graphs.py), fed by two pinned
non-blocking copies per step.

Measured on the H200 (1x128 tokens): the step's inputs took ten small copies and fills, each
issued from Python (~0.75 ms while the GPU waited), before the first piece ran. Here the host
writes every input of a step into two pinned buffers (int64: token ids, positions, KV slots,
logits rows; int32: cu_seqlens, context lens, block tables of up to `max_seqs` sequences) and
each goes up in one copy into the device buffers the pieces were captured on. Segments start
16 bytes apart (Triton specialises kernels on pointer alignment). The next step waits for the
previous copies (an event) before it rewrites the host buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NULL_SLOT = 0  # slot 0 of the null block (block 0): where padding tokens write their K/V


def _aligned(n: int) -> int:
    return -(-n // 4) * 4  # 16 bytes of int32


class FusedInputs:
    def __init__(self, max_tokens: int, max_seqs: int, width: int, device: torch.device):
        n, s, w = max_tokens, max_seqs, width
        self.max_tokens, self.max_seqs, self.width = n, s, w
        self.dev64 = torch.zeros(4 * n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.rows = self.dev64.view(4, n)
        self._off = (0, _aligned(s + 1), _aligned(s + 1) + _aligned(s))
        self.dev32 = torch.zeros(self._off[2] + s * w, dtype=torch.int32, device=device)
        self.cu = self.dev32[: s + 1]
        self.lens = self.dev32[self._off[1] : self._off[1] + s]
        self.tables = self.dev32[self._off[2] :].view(s, w)
        cuda = device.type == "cuda"
        self.host64, self.host32 = (
            torch.zeros_like(t, device="cpu").pin_memory() if cuda else torch.zeros_like(t)
            for t in (self.dev64, self.dev32)
        )
        self._h64, self._h32 = self.host64.numpy(), self.host32.numpy()
        self._copied = torch.cuda.Event() if cuda else None

    def load(
        self,
        n: int,
        ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        rows: Sequence[int],
        cu: Sequence[int],
        lens: Sequence[int],
        tables: Sequence[Sequence[int]],
    ) -> None:
        """A step of len(ids) tokens padded to `n` (token 0 at position 0 into the null slot),
        its len(lens) <= max_seqs sequences (the others: no tokens); then the two copies."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the buffers
        big, t, b = self.max_tokens, len(ids), len(lens)
        h = self._h64
        h[:t], h[t:n] = ids, 0
        h[big : big + t], h[big + t : big + n] = positions, 0
        h[2 * big : 2 * big + t], h[2 * big + t : 2 * big + n] = slots, NULL_SLOT
        h[3 * big : 3 * big + len(rows)] = rows
        h32, (_, lens_at, tables_at) = self._h32, self._off
        h32[: b + 1], h32[b + 1 : self.max_seqs + 1] = cu, cu[-1]
        h32[lens_at : lens_at + b], h32[lens_at + b : lens_at + self.max_seqs] = lens, 0
        for i, table in enumerate(tables):
            start = tables_at + i * self.width
            h32[start : start + len(table)] = table
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
