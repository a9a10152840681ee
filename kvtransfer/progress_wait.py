"""How long ucxx's progress thread sleeps in epoll_wait when no UCX event wakes it.

ucxx starts the thread with a 1 ms wait (`ThreadMode`: `epoll_timeout=1`), so an idle worker
wakes a thousand times a second: measured 1.9 % of a core on CPU (TCP) and 3-4 % on an H200, over
issue 32's 2 % goal. The thread does not need the timeout to make progress: UCX wakes it at once
for its own events (a message on TCP or shared memory; cuda_ipc / cuda_copy completions, which
UCX signals through the worker's event fd; every request this process submits, which ucxx
signals). Measured on CPU over TCP (loopback, 1 KiB round trips): wait 1 ms: idle 1.9 %, hot
round trip 0.11 ms, after 0.5 s idle 0.42 ms; wait 100 ms: idle 0.1 %, 0.08 ms, 0.43 ms.

    progress_wait_ms(configured, device)  the wait to use: kv_transfer.progress_wait_ms, or by
                                          default 100 ms on CPU and ucxx's 1 ms on CUDA (kept
                                          until the H200 measures the longer wait: the cuda_ipc
                                          path's completions are the ones to check)
    apply_progress_wait(ms)               restarts ucxx's progress thread with that wait; call
                                          it before any transfer (the worker's start-up)
"""

from __future__ import annotations

import logging

UCXX_DEFAULT_MS = 1
CPU_DEFAULT_MS = 100

log = logging.getLogger("splitserve.kvtransfer")


def progress_wait_ms(configured: int | None, device_type: str) -> int:
    if configured is not None:
        return configured
    return CPU_DEFAULT_MS if device_type == "cpu" else UCXX_DEFAULT_MS


def apply_progress_wait(ms: int) -> bool:
    """True when the progress thread now waits `ms` (-1: for events only); False when ucxx's
    own thread was left as it is (the default wait, a polling mode, an unknown ucxx)."""
    if ms == UCXX_DEFAULT_MS:
        return False
    import ucxx

    try:
        ctx = ucxx.core._get_ctx()  # the process's one context (ucxx 0.52; private)
        if ctx.progress_mode != "thread":  # polling modes never sleep: nothing to set
            return False
        ctx.worker.stop_progress_thread()
        ctx.worker.start_progress_thread(polling_mode=False, epoll_timeout=ms)
    except (AttributeError, TypeError) as exc:
        log.warning("kv_transfer.progress_wait_ms %d not applied (this ucxx: %s)", ms, exc)
        return False
    log.info("UCX progress thread waits %s between events", "for events" if ms < 0 else f"{ms} ms")
    return True
