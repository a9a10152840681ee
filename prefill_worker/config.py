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

from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitserve.engine.config import EngineConfig
from splitserve.engine.config_file import load_config
from splitserve.engine.grpc_service import ServerConfig
from splitserve.kvtransfer.config import KvTransferConfig


class PrefillWorkerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: EngineConfig
    server: ServerConfig = ServerConfig()
    kv_transfer: KvTransferConfig = KvTransferConfig()
    lease_ttl_s: float = Field(30.0, gt=0, description="how long finished KV stays pinned for the decode side")
    max_lease_ttl_s: float = Field(600.0, gt=0, description="longest lease a request may ask for")
    enable_prefix_cache: bool = True
    max_prefix_hashes: int = Field(4096, ge=0, description="most block hashes GetLoad returns")
    warmup: bool = Field(True, description="run one prefill before serving (then zero the KV pool)")

    @model_validator(mode="after")
    def _ttl_bounds(self) -> PrefillWorkerConfig:
        if self.lease_ttl_s > self.max_lease_ttl_s:
            raise ValueError(f"lease_ttl_s ({self.lease_ttl_s}) must not exceed max_lease_ttl_s "
                             f"({self.max_lease_ttl_s})")
        return self

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PrefillWorkerConfig:
        """YAML file (optional) with dotted-key overrides on top, e.g. {"engine.cache.block_size": 8}."""
        return load_config(cls, path, overrides)
