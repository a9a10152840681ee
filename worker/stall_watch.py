"""Health that follows the engine: no worker answers SERVING while its engine is stuck.

    StallWatch(busy, progress, failed, stall_s, set_serving)    one per worker, on its event loop
      every tick:  progress() moved, or nothing queued (busy() false)  -> the clock restarts
                   busy() and no progress for stall_s                  -> NOT_SERVING ("stalled")
                   progress again                                      -> SERVING ("recovered")
                   failed()                                            -> NOT_SERVING for good

`progress` is a counter the engine bumps after every step (and, in the decode loop, after every
batch of commands it applies); `busy` says work is queued. Timing a stall from the last time the
watch saw the engine idle or moving (not from the last step) means a worker idle for an hour
is not judged stuck the moment a request arrives. The watch only reads two numbers, so the
health answer never waits on the engine thread. A drain's NOT_SERVING is final: grpc's health
servicer ignores set() after enter_graceful_shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class StallWatch:
    def __init__(
        self,
        name: str,
        busy: Callable[[], bool],
        progress: Callable[[], int],
        failed: Callable[[], bool],
        stall_s: float,
        set_serving: Callable[[bool], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._busy, self._progress, self._failed = busy, progress, failed
        self.stall_s = stall_s
        self._set_serving = set_serving
        self._clock = clock
        self.tick_s = min(0.5, stall_s / 4)
        self.stalled = False
        self.stalls = 0  # times it went NOT_SERVING for a stall
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"{self.name} stall watch"
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        seen, since = self._progress(), self._clock()
        while not self._failed():
            await asyncio.sleep(self.tick_s)
            now, count = self._clock(), self._progress()
            if count != seen or not self._busy():
                seen, since = count, now
            stalled = now - since > self.stall_s
            if stalled != self.stalled:
                self.stalled = stalled
                if stalled:
                    self.stalls += 1
                    log.error(
                        "%s engine made no progress for %.1fs with work queued; health NOT_SERVING until "
                        "it moves again",
                        self.name,
                        now - since,
                    )
                else:
                    log.warning("%s engine is making progress again; health SERVING", self.name)
                await self._set_serving(not stalled and not self._failed())
        log.error("%s engine failed; health NOT_SERVING", self.name)
        await self._set_serving(False)
