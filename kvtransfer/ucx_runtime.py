"""How a worker process runs ucxx: completions delivered by ucxx's notifier thread, not polled.

By default ucxx's asyncio API waits for a request by polling it from the event loop
(`wait_yield`: `await asyncio.sleep(0)` until done). The KV listener always has a receive
pending on every open endpoint (the next pull's request), so an idle prefill worker kept about
one CPU core busy after its first hand-over (measured: 63 % of a core in-process, 1-2 % with
this). With `UCXPY_ENABLE_PYTHON_FUTURE=1`, ucxx's notifier thread resolves a Python future
when a request completes, and an idle worker sleeps.

The notifier thread is bound to the event loop that exists when ucxx's context is created, so
this suits a process with one event loop for its lifetime (a worker, and the TP followers it
spawns, which inherit the environment), not a test process that calls asyncio.run repeatedly.
It is not a daemon thread: stop it before the interpreter joins threads at exit.
"""

from __future__ import annotations

import os
import threading

ENV = "UCXPY_ENABLE_PYTHON_FUTURE"


def use_notifier_thread() -> None:
    """Call before the process's first ucxx call; a value the user set in the environment wins."""
    os.environ.setdefault(ENV, "1")
    if os.environ[ENV] == "0":
        return

    def stop() -> None:
        import sys

        ucxx = sys.modules.get("ucxx")
        if ucxx is not None:
            ucxx.stop_notifier_thread()

    # runs before non-daemon threads are joined at exit (plain atexit runs after: a hang)
    threading._register_atexit(stop)  # noqa: SLF001 - the hook concurrent.futures uses too
