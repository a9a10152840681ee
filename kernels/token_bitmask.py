"""Applies structured-output token masks to logits on the device, in place.

`bitmask` [n, W] int32 holds one bit per token (bit t % 32 of word t // 32, as llguidance
writes it): 1 = allowed. Disallowed tokens get -inf, so every sampling mode (greedy argmax,
filters, the seeded race) can only pick an allowed token. Plain torch ops with static
shapes, so it runs inside a captured CUDA graph; rows whose mask is all ones are unchanged.
"""

from __future__ import annotations

import torch

_BITS: dict[torch.device, torch.Tensor] = {}


def _bits(device: torch.device) -> torch.Tensor:
    """[32] int32: 1 << i (bit 31 is the sign bit: -2^31, still one bit)."""
    t = _BITS.get(device)
    if t is None:
        one = torch.ones(32, dtype=torch.int64)
        values = (one << torch.arange(32)).to(torch.int32)  # wraps 2^31 to -2^31
        t = _BITS[device] = values.to(device)
    return t


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [n, V] (fp32) <- -inf where bitmask [n, ceil(V / 32)] has a 0 bit."""
    n, vocab = logits.shape
    banned = (bitmask[:n].unsqueeze(-1) & _bits(logits.device)) == 0  # [n, W, 32] bool
    logits.masked_fill_(banned.reshape(n, -1)[:, :vocab], float("-inf"))
