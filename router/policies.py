"""Which worker gets a request: pure functions of load snapshots (no I/O, no clocks).

    WorkerView  one healthy worker as the registry last saw it (GetLoad) plus the router's
                own count of requests it has sent there and not seen finish
    Policy      choose(views, prompt_token_ids) -> one of views

    round_robin    next worker in address order
    least_loaded   fewest queued + running requests, then the most free KV (by fraction)
    prefix_aware   (prefill) the worker caching the longest prefix of the prompt, per its
                   GetLoad block keys; but when the queues are clearly unbalanced
                   (longest - shortest > abs threshold and longest > rel threshold x shortest)
                   the least loaded worker wins, as in SGLang's cache-aware router

The queue estimate is max(polled waiting + running, router in-flight): a poll is up to one
interval old, while the router's own count moves the moment it sends a request.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.request.block_hash import block_keys
from splitserve.router.config import PolicyName, PrefixPolicyConfig


@dataclass(frozen=True)
class WorkerView:
    address: str
    num_running: int = 0
    num_waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 0
    prefix_keys: frozenset[bytes] = field(default_factory=frozenset)  # cached blocks' keys
    in_flight: int = 0  # requests this router sent there and has not seen finish

    @property
    def queue(self) -> int:
        return max(self.num_running + self.num_waiting, self.in_flight)

    @property
    def free_fraction(self) -> float:
        return self.free_blocks / self.total_blocks if self.total_blocks else 0.0


class Policy(Protocol):
    name: str

    def choose(self, views: Sequence[WorkerView], prompt: Sequence[int]) -> WorkerView: ...


def _nonempty(views: Sequence[WorkerView]) -> None:
    if not views:
        raise ValueError("no worker to choose from")


def least_loaded_key(v: WorkerView) -> tuple:
    return (v.queue, -v.free_fraction, v.address)


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, views: Sequence[WorkerView], prompt: Sequence[int] = ()) -> WorkerView:
        _nonempty(views)
        ordered = sorted(views, key=lambda v: v.address)
        return ordered[next(self._turn) % len(ordered)]


class LeastLoaded:
    name = "least_loaded"

    def choose(self, views: Sequence[WorkerView], prompt: Sequence[int] = ()) -> WorkerView:
        _nonempty(views)
        return min(views, key=least_loaded_key)


def cached_prefix_blocks(
    view: WorkerView, prompt: Sequence[int], keys: Sequence[bytes] | None = None
) -> int:
    """Leading full blocks of `prompt` whose chained key the worker reports as cached. A chained
    key names its whole prefix, so the longest reported block counts, even when the capped
    summary left out an earlier one."""
    if not view.prefix_keys or view.block_size <= 0:
        return 0
    keys = block_keys(prompt, view.block_size) if keys is None else keys
    for i in range(len(keys) - 1, -1, -1):
        if keys[i] in view.prefix_keys:
            return i + 1
    return 0


class PrefixAware:
    name = "prefix_aware"

    def __init__(self, cfg: PrefixPolicyConfig | None = None) -> None:
        self.cfg = cfg or PrefixPolicyConfig()

    def unbalanced(self, views: Sequence[WorkerView]) -> bool:
        queues = [v.queue for v in views]
        lo, hi = min(queues), max(queues)
        return hi - lo > self.cfg.balance_abs_threshold and hi > self.cfg.balance_rel_threshold * lo

    def choose(self, views: Sequence[WorkerView], prompt: Sequence[int]) -> WorkerView:
        _nonempty(views)
        if len(views) == 1 or self.unbalanced(views):
            return min(views, key=least_loaded_key)
        by_block_size: dict[int, list[bytes]] = {}
        matched = {}
        for v in views:
            if v.block_size > 0 and v.block_size not in by_block_size:
                by_block_size[v.block_size] = block_keys(prompt, v.block_size)
            matched[v.address] = cached_prefix_blocks(
                v, prompt, by_block_size.get(v.block_size, [])
            )
        best = max(matched.values())
        if best < self.cfg.min_match_blocks:
            return min(views, key=least_loaded_key)
        return min((v for v in views if matched[v.address] == best), key=least_loaded_key)


def make_policy(name: PolicyName, prefix: PrefixPolicyConfig | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_aware":
        return PrefixAware(prefix)
    raise ValueError(
        f"unknown routing policy {name!r}; use round_robin, least_loaded or prefix_aware"
    )
