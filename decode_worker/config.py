"""Configuration of a decode worker: engine (model, KV pool, batch limits), server, graphs.

    DecodeWorkerConfig
      engine: EngineConfig      model_path, device, dtype, cache.{block_size,num_blocks},
                                scheduler.{max_batch_size, max_model_len, max_queue_len, ...}
      server: ServerConfig      host, port, metrics_port, drain_grace_s, ...
      cuda_graph: bool          capture decode steps as CUDA graphs (CUDA only; --no-cuda-graph)
      cuda_graph_sizes          batch sizes to capture; None: 1, 2, 4, 8, then steps of 8
      overlap: bool             enqueue step N+1 before reading step N's tokens
      prefill_chunk_tokens      local-prefill tokens per step (chunked prefill; 0: whole prompts)

YAML (every section optional but engine.model_path):

    engine:
      model_path: /models/llama-3.2-1b
      cache: {block_size: 16, num_blocks: 8192}
      scheduler: {max_batch_size: 256, max_model_len: 4096, max_queue_len: 1024}
    server: {host: 0.0.0.0, port: 50071, metrics_port: 9471}
    cuda_graph: true
    cuda_graph_sizes: [1, 2, 4, 8, 16, 32, 64, 128, 256]

loaded by `load(path, overrides)` (CLI flags override file values). Every model is frozen
with extra="forbid"; a bad value is one line naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from splitserve.config.engine_config import EngineConfig, check_token_counts
from splitserve.config.files import load_config
from splitserve.kvtransfer.config import KvTransferConfig, RequestFaults
from splitserve.service.grpc_service import ServerConfig

GRAPH_STEP = 8  # capture sizes go 1, 2, 4, 8, then in steps of this


class DecodeFaults(RequestFaults):
    """For tests only (tests/faults): delays on purpose, so a test can land a cancel or a kill
    between a request's arrival and its admission, or stall the engine. Off by default."""

    delay_before_pull_s: float = Field(
        0.0,
        ge=0,
        description="test only: a handed-off request waits this long "
        "with its blocks reserved before the KV pull",
    )

    step_delay_s: float = Field(
        0.0,
        ge=0,
        description="test only: a decode step holding a request this hits "
        "first sleeps this long on the engine thread (a stuck engine)",
    )

    def pull_delay(self, request_id: str) -> float:
        return self.delay_before_pull_s if self.hits(request_id) else 0.0

    def step_delay(self, request_ids) -> float:
        return self.step_delay_s if self.step_delay_s and any(map(self.hits, request_ids)) else 0.0


class DecodeWorkerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: EngineConfig
    server: ServerConfig = ServerConfig()
    kv_transfer: KvTransferConfig = KvTransferConfig()
    cuda_graph: bool = Field(
        True, description="capture the decode step as CUDA graphs (ignored on CPU)"
    )
    cuda_graph_sizes: tuple[int, ...] | None = Field(
        None,
        description="batch sizes to capture; None: 1, 2, 4, 8, then steps of 8 up to max_batch_size",
    )
    prefill_graph_sizes: tuple[int, ...] | None = Field(
        None,
        description="token counts of the piecewise graphs of the local prefill (recompute, "
        "colocated prompts), captured with cuda_graph into the decode graphs' pool (a count "
        "above the local step budget is captured at it); None: 16, 32, ... up to "
        "max_num_batched_tokens (at most 8192), or up to prefill_chunk_tokens when that is "
        "smaller",
    )
    prefill_chunk_tokens: int = Field(
        512,
        ge=0,
        description="local-prefill tokens (colocated prompts, recompute) per engine step, computed "
        "before that step's decode: a long prompt spreads over several steps while running "
        "sequences keep decoding (chunked prefill); 0: each admitted prompt whole in one step",
    )
    overlap: bool = Field(True, description="enqueue step N+1 before reading step N's tokens")
    rehearsal: bool | None = Field(
        None,
        description="after warm-up, run one colocated request per token bucket of the local "
        "prefill through the engine before serving (no trace left: decode_worker/rehearsal.py); "
        "None: on CUDA only",
    )
    warmup_steps: int = Field(
        2, ge=1, le=16, description="eager runs of each graph size before capture"
    )
    faults: DecodeFaults = DecodeFaults()

    @field_validator("prefill_graph_sizes")
    @classmethod
    def _prefill_graph_sizes(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return check_token_counts(v)

    @field_validator("cuda_graph_sizes")
    @classmethod
    def _sizes(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is not None and (not v or any(s < 1 for s in v)):
            raise ValueError("must be a non-empty list of batch sizes >= 1 (e.g. 1,2,4,8,16)")
        return v


def default_graph_sizes(max_batch_size: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s < GRAPH_STEP]
    sizes += list(range(GRAPH_STEP, max_batch_size + GRAPH_STEP, GRAPH_STEP))
    return sizes


def capture_sizes(cfg: DecodeWorkerConfig, max_batch_size: int, usable_blocks: int) -> list[int]:
    """The sizes the graph runner captures: configured (or default) sizes, capped by the max
    batch and by the KV pool (every running sequence holds at least one block)."""
    cap = min(max_batch_size, usable_blocks)
    wanted = cfg.cuda_graph_sizes or default_graph_sizes(max_batch_size)
    return sorted({s for s in wanted if s <= cap})


def load(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> DecodeWorkerConfig:
    """YAML file (optional) with dotted-key overrides on top, e.g. {"engine.cache.block_size": 8};
    a bad value raises ConfigError (a ValueError), one line naming the field."""
    return load_config(DecodeWorkerConfig, path, overrides)
