"""Chooses the Triton kernel or the torch reference for each op.

CUDA tensors take the Triton kernels; CPU tensors take the torch reference. Tests force the
Triton path on CPU (under TRITON_INTERPRET=1) with `force_triton()`; a ContextVar keeps that
choice scoped to the `with` block instead of a process-wide setting.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_FORCE_TRITON: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "splitserve_force_triton", default=False
)


@contextlib.contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    token = _FORCE_TRITON.set(enabled)
    try:
        yield
    finally:
        _FORCE_TRITON.reset(token)


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or _FORCE_TRITON.get()
