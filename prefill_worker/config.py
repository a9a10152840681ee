"""PrefillWorkerConfig: the engine, the server, and the prefill worker's own knobs.

YAML (every section optional but engine.model_path):

    engine:
      model_path: /models/llama-3.2-1b
      cache: {block_size: 16, num_blocks: 4096}
      scheduler: {max_num_batched_tokens: 8192, max_model_len: 8192, max_queue_len: 1024}
    server: {host: 0.0.0.0, port: 50061, metrics_port: 9461, advertise_host: prefill-0}
    lease_ttl_s: 30
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from splitserve.config.engine_config import EngineConfig, check_token_counts
from splitserve.config.files import load_config
from splitserve.kvtransfer.config import KvTransferConfig, RequestFaults, TransferFaults
from splitserve.service.grpc_service import ServerConfig


class PrefillFaults(RequestFaults):
    """For tests only (tests/faults): slow steps and broken transfers on purpose, so a test can
    land an abort, a kill or a corruption exactly where it wants. Off by default."""

    last_chunk_delay_s: float = Field(
        0.0,
        ge=0,
        description="test only: the step holding a prompt's last chunk sleeps this long first",
    )
    reply_delay_s: float = Field(
        0.0,
        ge=0,
        description="test only: a Prefill call waits this long between "
        "its lease grant and its reply (a reply slow on the wire)",
    )
    transfer: TransferFaults = TransferFaults()

    def slow_last_chunk(self, request_ids) -> float:
        return self.last_chunk_delay_s if any(map(self.hits, request_ids)) else 0.0

    def reply_delay(self, request_id: str) -> float:
        return self.reply_delay_s if self.hits(request_id) else 0.0


class PrefillWorkerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: EngineConfig
    server: ServerConfig = ServerConfig()
    kv_transfer: KvTransferConfig = KvTransferConfig()
    lease_ttl_s: float = Field(
        30.0, gt=0, description="how long finished KV stays pinned for the decode side"
    )
    max_lease_ttl_s: float = Field(600.0, gt=0, description="longest lease a request may ask for")
    enable_prefix_cache: bool = True
    max_prefix_hashes: int = Field(4096, ge=0, description="most block hashes GetLoad returns")
    warmup: bool = Field(
        True,
        description="run every prefill shape and sampler variant before serving "
        "(then zero the KV pool)",
    )
    rehearsal: bool | None = Field(
        None,
        description="after warm-up (only with warmup on), run one request per token bucket up "
        "to the largest step through the engine's request path before serving (no trace left: "
        "rehearsal.py); None: on CUDA only",
    )
    cuda_graph: bool = Field(
        True,
        description="run prefill steps as piecewise CUDA graphs at token buckets "
        "(CUDA, tensor parallel size 1; ignored otherwise)",
    )
    prefill_graph_sizes: tuple[int, ...] | None = Field(
        None,
        description="token counts of the piecewise prefill graphs (a count above "
        "max_num_batched_tokens is captured at it); None: 16, 32, ... up to "
        "max_num_batched_tokens (at most 8192); larger steps run eagerly",
    )
    faults: PrefillFaults = PrefillFaults()

    @field_validator("prefill_graph_sizes")
    @classmethod
    def _prefill_graph_sizes(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return check_token_counts(v)

    @model_validator(mode="after")
    def _ttl_bounds(self) -> PrefillWorkerConfig:
        if self.lease_ttl_s > self.max_lease_ttl_s:
            raise ValueError(
                f"lease_ttl_s ({self.lease_ttl_s}) must not exceed max_lease_ttl_s "
                f"({self.max_lease_ttl_s})"
            )
        return self

    @model_validator(mode="after")
    def _rank_ports(self) -> PrefillWorkerConfig:
        last = self.kv_transfer.listen_port + self.engine.parallel.tensor_parallel_size - 1
        if self.kv_transfer.listen_port and last > 65535:
            raise ValueError(
                f"kv_transfer.listen_port {self.kv_transfer.listen_port}: tensor-parallel rank r listens "
                f"on listen_port + r, up to {last} > 65535; pick a lower listen_port"
            )
        return self

    @classmethod
    def load(
        cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None
    ) -> PrefillWorkerConfig:
        """YAML file (optional) with dotted-key overrides on top, e.g. {"engine.cache.block_size": 8}."""
        return load_config(cls, path, overrides)
