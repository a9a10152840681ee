"""The KV listener's wait for the next pull (kvtransfer/idle_wait.py): a grant wakes a cold
endpoint at once, and the endpoint stays hot (a probe every loop turn) for the pull that follows
the grant through the router, instead of backing off to millisecond sleeps."""

from __future__ import annotations

import asyncio
import time

from splitserve.kvtransfer import idle_wait


class _Ep:
    closed = False


def _waiter(monkeypatch, expecting: bool, last_message: float):
    probes = {"n": 0, "ready": False}

    def probe():
        probes["n"] += 1
        return probes["ready"]

    monkeypatch.setattr(idle_wait, "_prober", lambda ep: probe)
    wake = idle_wait.PullWake()
    task = asyncio.ensure_future(
        idle_wait.until_message(_Ep(), last_message, lambda: expecting, wake)
    )
    return task, wake, probes


def test_a_grant_wakes_a_cold_endpoint_and_keeps_it_hot(monkeypatch):
    monkeypatch.setattr(idle_wait, "COLD_SLEEP_S", 600.0)  # only the grant can wake it
    monkeypatch.setattr(idle_wait, "GRANT_HOT_S", 600.0)  # a stalled CI runner stays in it

    async def main():
        task, wake, probes = _waiter(monkeypatch, False, time.monotonic() - 60)
        for _ in range(20):
            await asyncio.sleep(0)
        assert probes["n"] == 1 and not task.done()  # cold: one probe, then asleep
        wake.notify()
        for _ in range(40):
            await asyncio.sleep(0)
        assert probes["n"] >= 10  # hot after the grant: a probe every loop turn
        probes["ready"] = True  # the pull's request arrives
        await asyncio.wait_for(task, 30)

    asyncio.run(main())


def test_without_a_recent_grant_a_waiting_endpoint_backs_off(monkeypatch):
    monkeypatch.setattr(idle_wait, "WARM_SLEEP_S", 600.0)
    waits = []
    real_wait = idle_wait.PullWake.wait

    async def counted_wait(self, timeout):
        waits.append(timeout)
        await real_wait(self, timeout)

    monkeypatch.setattr(idle_wait.PullWake, "wait", counted_wait)

    async def main():
        task, wake, probes = _waiter(monkeypatch, True, time.monotonic() - 60)
        for _ in range(40):
            await asyncio.sleep(0)
        # warm: every probe after the first follows a timed wait, never a bare loop turn
        assert waits and 1 <= probes["n"] <= len(waits) + 1
        assert waits == sorted(waits)  # backing off
        wake.notify()  # a grant ends the sleep at once and makes it hot
        probes["ready"] = True
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
