"""How long a request refused by a full queue should wait before it is sent again.

A full queue answers RESOURCE_EXHAUSTED with this hint: gRPC trailing metadata `retry-after-ms`
(request/errors.py), passed on by the router, and HTTP `Retry-After` in whole seconds on the
OpenAI front. A request that could never fit (more KV blocks than the pool has) gets no hint:
waiting cannot help it.

The hint is the time the queue now waiting would take to drain at the rate requests left it
(were admitted) over the last WINDOW_S seconds: a retry sooner would most likely meet the same
full queue. It is bounded to [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]; when nothing was admitted
within the window (the pool is held by long requests), it is MAX_RETRY_AFTER_S.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 10.0
MIN_RETRY_AFTER_S = 1.0  # HTTP's Retry-After counts whole seconds
MAX_RETRY_AFTER_S = 30.0


class QueueDrainRate:
    """Admissions from one queue over a sliding window, counted per whole second (so its memory
    is bounded by the window, whatever the rate)."""

    def __init__(
        self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        self._started = clock()
        self._seconds: deque[list[int]] = deque()  # [whole second, admissions in it], oldest first

    def admitted(self, n: int = 1) -> None:
        """`n` requests left the queue (were admitted) now."""
        second = math.floor(self._clock())
        if self._seconds and self._seconds[-1][0] == second:
            self._seconds[-1][1] += n
        else:
            self._seconds.append([second, n])
        self._trim(second)

    def _trim(self, now: float) -> None:
        while self._seconds and self._seconds[0][0] <= now - self._window_s:
            self._seconds.popleft()

    def retry_after_s(self, waiting: int) -> float:
        """The hint for a request refused while `waiting` requests are queued."""
        now = self._clock()
        self._trim(now)
        count = sum(n for _, n in self._seconds)
        if not count:
            return MAX_RETRY_AFTER_S
        span = min(self._window_s, max(now - self._started, MIN_RETRY_AFTER_S))
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, waiting * span / count))
