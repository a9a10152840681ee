"""Applies structured-output token masks to logits on the device, in place.

`bitmask` [n, W] int32 holds one bit per token (bit t % 32 of word t // 32, as llguidance
writes it): 1 = allowed. Disallowed tokens get -inf, so every sampling mode (greedy argmax,
filters, the seeded race) can only pick an allowed token. Plain torch ops with static
shapes, so it runs inside a captured CUDA graph; rows whose mask is all ones are unchanged.
"""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    t = _SHIFTS.get(device)
    if t is None:
        t = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return t


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [n, V] (fp32) <- -inf where bitmask [n, ceil(V / 32)] has a 0 bit."""
    n, vocab = logits.shape
    bits = (bitmask[:n].unsqueeze(-1) >> _shifts(logits.device)) & 1  # [n, W, 32]
    allowed = bits.reshape(n, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
