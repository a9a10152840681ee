"""Typed messages of the prefill engine, one per direction.

servicer ──PrefillSeq──▶ engine (scheduler: waiting -> running -> done)
servicer ◀─PrefillResult── engine (first token, cached tokens, lease or finish reason)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from splitserve.engine.sampler import TokenLogprobs
from splitserve.prefill_worker.leases import Lease
from splitserve.request.sampling_params import SamplingParams


@dataclass(eq=False)
class PrefillSeq:
    """One context-only request while the engine owns it."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    lease_ttl_s: float
    block_keys: list[bytes]  # of the prompt's full blocks (block_hash.block_keys)
    future: asyncio.Future
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # prompt tokens whose KV is in the cache
    num_cached: int = 0  # of those, served from the prefix cache
    num_registered: int = 0  # full blocks published to the prefix cache
    aborted: bool = False
    sampling_time_s: float = 0.0  # its first token's sampling (set by the step that samples it)
    matcher: object | None = None  # structured output: masks the first token (never advanced)
    first_kv_at: float = 0.0  # when its first KV was computed (streamed hand-over's wait metric)
    stream_token: str = ""  # what a streamed pull of it must present ("": none may attach)

    @property
    def num_remaining(self) -> int:
        return len(self.prompt) - self.num_computed


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    logprob: TokenLogprobs | None
    finish_reason: str | None  # "stop" / "length" when the first token ends the request
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    lease: Lease | None  # None exactly when finish_reason is set
    queue_time_s: float = 0.0  # arrival to admission
    compute_time_s: float = 0.0  # admission to the first token
    sampling_time_s: float = 0.0  # the first token's sampling (part of compute_time_s)
    handover_start_s: float = 0.0  # arrival to the lease grant (0: no lease)
