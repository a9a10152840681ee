"""A cheap payload checksum computed where the data lives (GPU or CPU) in one pass.

Words are summed per 1024-word row in int64, and row sums are weighted by their row index, so
truncation, zeroed or shifted regions and flipped bits change the value; integer wrap-around
makes the result independent of reduction order, hence equal on CPU and GPU.
"""

from __future__ import annotations

import torch

_ROW = 1024


def to_u64(checksum: torch.Tensor) -> int:
    return int(checksum.item()) & 0xFFFFFFFFFFFFFFFF


def payload_checksum_async(payload: torch.Tensor) -> torch.Tensor:
    """The checksum as a 0-d device tensor, queued on the current stream (no host sync)."""
    words = payload.reshape(-1).view(torch.uint8)
    pad = (-words.numel()) % (4 * _ROW)
    if pad:
        words = torch.cat((words, words.new_zeros(pad)))
    rows = words.view(torch.int32).view(-1, _ROW)
    row_sums = rows.sum(dim=1, dtype=torch.int64)
    weights = torch.arange(1, row_sums.numel() + 1, device=row_sums.device, dtype=torch.int64)
    return (row_sums * weights).sum()
