"""The green-context mode of `benchmarks/sm_partition.py`: both loads in one process, each on
a stream of its own CUDA green context (an SM partition: the prefill gets `share` percent of
the SMs, rounded to the partition granularity, the decode the rest), in two threads.

torch >= 2.12 gives a green context's stream (`GreenContext.Stream()`); older releases make
the context current for the calling thread (`set_context` / `pop_context`), which also makes
torch's current stream one of the context's. Each load is first timed alone in its partition,
which shows whether the partition took effect (a smaller one is slower).
"""

from __future__ import annotations

import threading

import torch

GRANULARITY = 8  # SMs per partition step on Hopper (the driver rounds to its own minimum)


def partition(share: int, total_sms: int) -> tuple[int, int]:
    """(prefill SMs, decode SMs) for a prefill share in percent."""
    prefill = max(GRANULARITY, round(total_sms * share / 100 / GRANULARITY) * GRANULARITY)
    decode = (total_sms - prefill) // GRANULARITY * GRANULARITY
    if decode < GRANULARITY:
        raise ValueError(f"a {share}% prefill share leaves the decode under {GRANULARITY} SMs")
    return prefill, decode


def _green_contexts():
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError:
        raise SystemExit(
            f"torch {torch.__version__} has no CUDA green contexts (torch.cuda.green_contexts); "
            "leave green out of --modes"
        ) from None
    return GreenContext


class _InContext:
    """Runs work inside a green context: on its stream, or with it current in this thread."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.stream = ctx.Stream() if hasattr(ctx, "Stream") else None

    def run(self, fn):
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                return fn()
        self.ctx.set_context()
        try:
            return fn()
        finally:
            self.ctx.pop_context()


def run_green(loops: dict, share: int, seconds: float, wait_go) -> dict[str, list[float]]:
    from sm_partition_roles import run_for

    green = _green_contexts()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    sms = dict(zip(("prefill", "decode"), partition(share, total)))
    try:
        where = {role: _InContext(green.create(num_sms=n, device_id=0)) for role, n in sms.items()}
    except RuntimeError as exc:  # the API imports everywhere; the driver may still refuse
        raise SystemExit(
            f"CUDA green contexts unavailable here ({' '.join(str(exc).split())[:200]}); "
            "leave green out of --modes"
        ) from None
    out: dict[str, list[float]] = {}
    alone_s = max(1.0, seconds / 4)
    for role, loop in loops.items():  # each alone in its partition first
        out[f"{role}_alone"] = where[role].run(lambda loop=loop: run_for(loop, alone_s))
    wait_go()
    errors: list[BaseException] = []

    def work(role: str) -> None:
        try:
            out[role] = where[role].run(lambda: run_for(loops[role], seconds))
        except BaseException as exc:  # re-raised below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in loops]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    out["sms"] = [sms["prefill"], sms["decode"]]
    return out
