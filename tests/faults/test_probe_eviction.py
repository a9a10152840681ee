"""Steady health, fast eviction kept (router/registry.py): a live worker whose probes time out
(here: SIGSTOPped, the extreme of busy) is not evicted by one or two slow probes; a worker that
stays wedged goes after `probe_failures_to_evict` of them (reason probe_timeout) and comes back
when it answers; a killed one goes at once (connection refused), within the old bound."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from fault_helpers import start_worker
from router_helpers import router_config, running_router, wait_until

PROBE_TIMEOUT_S = 2.0  # long enough that a resumed process answers the next probe in time
POLL_S = 0.1


async def _max_slow_probes(worker, until, timeout: float = 60.0) -> int:
    """The highest run of slow probes seen while polling, until `until()` holds."""
    most, deadline = 0, time.monotonic() + timeout
    while not until():
        most = max(most, worker.slow_probes)
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
    return max(most, worker.slow_probes)


def test_slow_probes_do_not_evict_a_live_worker_but_a_wedged_or_dead_one_goes(
    tiny_llama, cluster, procs
):
    decode, _ = start_worker(procs, "decode", tiny_llama)
    registry = {
        "poll_interval_s": POLL_S,
        "probe_timeout_s": PROBE_TIMEOUT_S,
        "probe_failures_to_evict": 3,
    }

    async def body():
        cfg = router_config(
            tiny_llama, [cluster.prefill], [decode.address, cluster.decode], registry=registry
        )
        async with running_router(cfg) as (r, _):
            await wait_until(
                lambda: all(w.healthy for w in r.registry.workers()), 20, "every worker healthy"
            )
            w = r.registry.get(decode.address)
            # 1. one slow probe, then the worker answers again: never evicted
            os.kill(decode.proc.pid, signal.SIGSTOP)
            await _max_slow_probes(w, lambda: w.slow_probes >= 1)
            os.kill(decode.proc.pid, signal.SIGCONT)
            slow_seen = await _max_slow_probes(w, lambda: w.slow_probes == 0 and w.probe_ok)
            first = dict(r.metrics.evictions("decode"))
            stayed = w.healthy
            # 2. wedged for good: evicted after three slow probes in a row, back once it answers
            os.kill(decode.proc.pid, signal.SIGSTOP)
            wedged_runs = await _max_slow_probes(w, lambda: not w.healthy)
            wedged = dict(r.metrics.evictions("decode"))
            os.kill(decode.proc.pid, signal.SIGCONT)
            await wait_until(lambda: w.healthy, 30, "the resumed worker back in rotation")
            # 3. killed: the next probe is refused, evicted at once
            decode.kill()
            t0 = time.monotonic()
            await wait_until(lambda: not w.healthy, 10, "the killed worker evicted")
            killed_s = time.monotonic() - t0
            dead = dict(r.metrics.evictions("decode"))
        return slow_seen, first, stayed, wedged_runs, wedged, killed_s, dead

    slow_seen, first, stayed, wedged_runs, wedged, killed_s, dead = asyncio.run(body())
    assert 1 <= slow_seen < 3 and first == {} and stayed, (slow_seen, first)
    assert wedged_runs >= 3 and wedged == {"probe_timeout": 1}, (wedged_runs, wedged)
    assert dead == {"probe_timeout": 1, "refused": 1}, dead
    assert killed_s < 3.0, killed_s  # one poll (0.1 s) + a refused connect; the old bound
