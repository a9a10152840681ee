"""Counts Triton kernel compilations in this process, through Triton's JIT hooks.

A JIT function compiles (or loads from the on-disk cache) whenever it is launched with a
specialisation it has not run before in this process: new constexprs, dtypes, an int argument
that becomes 1 or a multiple of 16, a pointer's 16-byte alignment. Each such miss stalls the
launching thread (hundreds of milliseconds cold, tens from the disk cache), so the workers warm
every shape before SERVING and export this count (worker/kernel_metrics.py), which must not
move while serving.

The hook is Triton's `knobs.runtime.jit_post_compile_hook` (Triton >= 3.4; called after every
compilation, also in the async-compile mode), or `JITFunction.compiled_hook` on older Triton.
An existing hook is kept and called first.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_count = 0
_serving = False  # set once a worker serves: a compilation from then on is logged
_installed: str | None = None  # which hook we hold, once installed
_names: dict[str, int] = {}  # kernel name -> compilations (the log says which kernel missed)


def _counted(prev):
    def hook(*args, **kwargs):
        global _count
        result = prev(*args, **kwargs) if prev is not None else None
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or "?"
        with _lock:
            _count += 1
            _names[name] = _names.get(name, 0) + 1
        if _serving:
            log.warning(
                "Triton compiled kernel %s while serving: a request waited on it; the warm-up "
                "(engine/prefill_warmup.py) missed this specialisation",
                name,
            )
        return result

    return hook


def install() -> str | None:
    """Installs the counting hook once per process; returns the hook's name (None: no Triton)."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        try:
            import triton
        except ImportError:
            return None
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
            runtime.jit_post_compile_hook = _counted(runtime.jit_post_compile_hook)
            _installed = "knobs.runtime.jit_post_compile_hook"
        else:
            from triton.runtime.jit import JITFunction

            JITFunction.compiled_hook = _counted(getattr(JITFunction, "compiled_hook", None))
            _installed = "JITFunction.compiled_hook"
        return _installed


def mark_serving(serving: bool = True) -> None:
    """While serving, each compilation is also logged as a warning (with its kernel's name)."""
    global _serving
    _serving = serving


def compilations() -> int:
    """Triton compilations since install() (all threads of this process)."""
    return _count


def by_kernel() -> dict[str, int]:
    """Compilations per kernel name since install()."""
    with _lock:
        return dict(_names)
