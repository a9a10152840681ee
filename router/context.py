"""What every Generate call shares: config, model facts, registry, policies, metrics, and the
background tasks (lease releases, aborts) that must outlive the call that started them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve.router.config import RouterConfig
from splitserve.router.intake import ModelInfo
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policies import Policy, make_policy
from splitserve.router.registry import WorkerRegistry

log = logging.getLogger(__name__)


class Background:
    """Fire-and-forget calls to workers, kept referenced until done; `drain` waits for them."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._guard(coro, name), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    async def _guard(coro: Coroutine[Any, Any, Any], name: str) -> None:
        try:
            await coro
        except grpc.aio.AioRpcError as err:
            log.warning("%s failed: %s (%s)", name, err.code().name, err.details())
        except Exception:  # noqa: BLE001 - a background call never takes the router down
            log.exception("%s failed", name)

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout: float) -> None:
        if self._tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*self._tasks, return_exceptions=True), timeout
                )


@dataclass
class RouterContext:
    cfg: RouterConfig
    model: ModelInfo
    registry: WorkerRegistry
    metrics: RouterMetrics
    prefill_policy: Policy = field(init=False)
    decode_policy: Policy = field(init=False)
    background: Background = field(default_factory=Background)

    def __post_init__(self) -> None:
        r = self.cfg.routing
        self.prefill_policy = make_policy(r.prefill_policy, r.prefix)
        self.decode_policy = make_policy(r.decode_policy, r.prefix)
