"""Per-caller request rate (token bucket) and concurrency limits, before any work is done.

`CallerLimits.admit(scope)` either returns a release callback for the request's end or raises
RESOURCE_EXHAUSTED with a retry hint: the time until the bucket holds a token again, or a short
fixed wait when the caller is at its concurrency limit (an in-flight request must end first).
The table of callers is bounded: idle full buckets are dropped once it grows past MAX_CALLERS.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from splitserve.request.errors import RequestError
from splitserve.router.auth_config import AuthConfig

MAX_CALLERS = 100_000
CONCURRENCY_RETRY_S = 1.0


class _Bucket:
    __slots__ = ("tokens", "stamp", "in_flight")

    def __init__(self, burst: int, now: float) -> None:
        self.tokens = float(burst)
        self.stamp = now
        self.in_flight = 0


class CallerLimits:
    def __init__(self, cfg: AuthConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = cfg.rate_per_s
        self.burst = cfg.burst
        self.max_concurrent = cfg.max_concurrent
        self.clock = clock
        self._callers: dict[str, _Bucket] = {}

    @property
    def enabled(self) -> bool:
        return self.rate is not None or self.max_concurrent is not None

    def admit(self, scope: str) -> Callable[[], None]:
        if not self.enabled:
            return lambda: None
        now = self.clock()
        b = self._callers.get(scope)
        if b is None:
            self._prune(now)
            b = self._callers[scope] = _Bucket(self.burst, now)
        if self.max_concurrent is not None and b.in_flight >= self.max_concurrent:
            raise RequestError.exhausted(
                f"this caller already has {b.in_flight} requests in flight, the limit per caller; "
                "wait for one to finish",
                CONCURRENCY_RETRY_S,
            )
        if self.rate is not None:
            b.tokens = min(self.burst, b.tokens + (now - b.stamp) * self.rate)
            b.stamp = now
            if b.tokens < 1.0:
                raise RequestError.exhausted(
                    f"rate limit: at most {self.rate:g} requests per second per caller (bursts of "
                    f"{self.burst}); retry later",
                    (1.0 - b.tokens) / self.rate,
                )
            b.tokens -= 1.0
        b.in_flight += 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                b.in_flight -= 1

        return release

    def _prune(self, now: float) -> None:
        if len(self._callers) < MAX_CALLERS:
            return
        full = self.burst / self.rate if self.rate else 0.0
        for scope, b in list(self._callers.items()):
            if b.in_flight == 0 and now - b.stamp >= full:
                del self._callers[scope]
        if len(self._callers) >= MAX_CALLERS:  # all busy: refuse newcomers rather than grow
            raise RequestError.exhausted(
                "too many distinct callers at once; retry later", CONCURRENCY_RETRY_S
            )
