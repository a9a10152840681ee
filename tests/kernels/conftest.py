"""Kernel tests: Triton kernels against the torch reference.

Without CUDA, the kernels run on CPU tensors in Triton's interpreter. TRITON_INTERPRET must be
set before any kernel module is decorated with @triton.jit; nothing imports triton earlier
(torch does not; `splitserve.kernels.ops` imports the Triton modules lazily), and
`test_interpreter_is_active` fails loudly if that ever changes. With CUDA present the flag is
left alone so `pytest -m gpu` compiles real kernels, and the CPU cases skip themselves.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
