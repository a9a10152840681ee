"""Importing benchmark scripts' sibling modules from tests without leaving `benchmarks/` on
sys.path: its `kernels.py` would shadow the `kernels` package that transformers looks for
(hub kernels), and a later test importing transformers would get ours."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """benchmarks/<name>.py (and the siblings it imports), with sys.path restored after."""
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved
