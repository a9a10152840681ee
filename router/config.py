"""RouterConfig: the served model, the server, the workers, routing and registry knobs.

YAML (every section optional but model_path):

    model_path: /models/llama-3.2-1b      # tokenizer.json + config.json (no weights are read)
    max_model_len: 8192                   # null: the model's max_position_embeddings
    server: {host: 0.0.0.0, port: 50051, metrics_port: 9451}
    http: {port: 8000}                    # OpenAI-compatible HTTP API (http_server.py); unset: off
    # TLS (docs/tls.md): server.tls {cert_file, key_file, client_ca_file}, also the HTTP front's
    # unless http.tls is set; workers_tls {ca_file, cert_file, key_file}: router -> workers
    workers:
      prefill: [prefill-0:50061, prefill-1:50061]
      decode: [decode-0:50071]
    routing:
      colocated: false                    # true: no prefill workers, decode workers do both (comparison)
      prefill_policy: prefix_aware        # round_robin | least_loaded | prefix_aware
      decode_policy: least_loaded         # round_robin | least_loaded
      prefix: {balance_abs_threshold: 4, balance_rel_threshold: 1.5, min_match_blocks: 1}
    registry: {poll_interval_s: 0.5, probe_timeout_s: 1.0, heartbeat_timeout_s: 3.0}
    auth: {api_keys_file: /run/secrets/api-keys}  # auth_config.py: keys, limits, cluster secret
    control: {host: 10.0.0.2, port: 50052}        # worker registration on a private listener
    max_prompt_bytes: 1048576             # limits before work (INVALID_ARGUMENT / HTTP 400):
    max_stop_strings: 16                  # prompt text, stop strings; max_tokens must fit in
    max_stop_string_chars: 256            # max_model_len after the prompt

Loaded by `RouterConfig.load(path, overrides)`; a bad value is one line naming the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from splitserve.config.files import load_config
from splitserve.request.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from splitserve.router.auth_config import AuthConfig, ControlConfig
from splitserve.service.grpc_service import ServerConfig
from splitserve.service.tls import TlsClientConfig, TlsServerConfig

PolicyName = Literal["round_robin", "least_loaded", "prefix_aware"]
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[\w.-]+):(\d{1,5})$")


MAX_ADDRESS_LEN = 261  # a DNS name (253 characters), ':' and a port


def check_address(address: str) -> str:
    """host:port (or [v6]:port) with a port in 1..65535; raises ValueError saying what is wrong."""
    if len(address) > MAX_ADDRESS_LEN:  # (the message must not echo it whole: gRPC caps details)
        raise ValueError(
            f"worker address {address[:40]!r}... is {len(address)} characters long, over "
            f"{MAX_ADDRESS_LEN}; give a host:port (e.g. 10.0.0.5:50061)"
        )
    m = _ADDRESS.match(address)
    if not m or not 0 < int(m[2]) < 65536:
        raise ValueError(f"worker address {address!r} is not host:port (e.g. 10.0.0.5:50061)")
    return address


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WorkersConfig(_Frozen):
    """Workers known from the start (more may register over RouterControl)."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    @field_validator("prefill", "decode")
    @classmethod
    def _addresses(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for a in v:
            check_address(a)
        if len(set(v)) != len(v):
            raise ValueError("lists an address twice")
        return v

    @model_validator(mode="after")
    def _disjoint(self) -> WorkersConfig:
        both = sorted(set(self.prefill) & set(self.decode))
        if both:
            raise ValueError(
                f"{both[0]} is listed as both a prefill and a decode worker; one role per address"
            )
        return self


class PrefixPolicyConfig(_Frozen):
    """Cache-aware prefill routing (SGLang's rule): follow the longest cached prefix unless
    the queues are clearly unbalanced, then take the shortest queue."""

    balance_abs_threshold: int = Field(
        4, ge=0, description="queue difference that counts as unbalanced ..."
    )
    balance_rel_threshold: float = Field(
        1.5, ge=1.0, description="... together with longest > this x shortest"
    )
    min_match_blocks: int = Field(
        1, ge=1, description="fewest cached blocks that make a prefix worth following"
    )


class RoutingConfig(_Frozen):
    colocated: bool = Field(
        False,
        description="no prefill workers: each request goes to a decode worker alone, "
        "which computes the prompt and decodes in one batch loop (to "
        "compare against disaggregated serving on the same machine)",
    )
    prefill_policy: PolicyName = "prefix_aware"
    decode_policy: PolicyName = "least_loaded"
    prefix: PrefixPolicyConfig = PrefixPolicyConfig()
    prefill_retry: bool = Field(
        True, description="retry a prefill that failed UNAVAILABLE once, on another worker"
    )
    decode_retry: bool = Field(
        True,
        description="retry a Decode that failed UNAVAILABLE before its first chunk "
        "(a worker gone or draining) once, on another decode worker",
    )
    kv_streaming: bool = Field(
        True,
        description="streamed KV hand-over: call Decode as soon as the prefill worker is "
        "chosen, so the KV streams layer by layer while the prompt is computed (only where "
        "both workers report GetLoad.kv_streaming); off: Decode after Prefill returns",
    )
    release_lease_after_decode: bool = Field(
        False,
        description="also release the prefill lease once every decode stream has started (a second "
        "ReleaseLease per request); off: the decode worker's pull releases it, and the router "
        "releases it only when the decode worker says it recomputed the prompt instead "
        "(DecodeResponse.kv_recomputed) or the request ended before Decode took it",
    )

    @field_validator("decode_policy")
    @classmethod
    def _decode_has_no_prefix_cache(cls, v: str) -> str:
        if v == "prefix_aware":
            raise ValueError(
                "decode workers report no prefix cache; use least_loaded or round_robin"
            )
        return v


class RegistryConfig(_Frozen):
    poll_interval_s: float = Field(
        0.5, gt=0, le=60, description="health Check + GetLoad of every worker"
    )
    probe_timeout_s: float = Field(
        1.0, gt=0, le=60, description="a probe slower than this counts as failed"
    )
    probe_failures_to_evict: int = Field(
        3,
        ge=1,
        le=100,
        description="consecutive timed-out probes before a busy worker is evicted; a refused "
        "connection, a broken transport, NOT_SERVING or a request's UNAVAILABLE "
        "evicts at once",
    )
    heartbeat_interval_s: float = Field(
        1.0, gt=0, description="what registered workers are told to use"
    )
    heartbeat_timeout_s: float = Field(
        3.0, gt=0, description="silence after which a registered worker is evicted"
    )
    forget_after_s: float = Field(
        60.0, gt=0, description="silence after which it is removed from the registry"
    )
    max_prefix_hashes: int = Field(
        4096, ge=0, description="block hashes asked of prefill workers per poll"
    )
    verify_addresses: bool = Field(
        True,
        description="refuse a RegisterWorker whose address the router cannot dial (health Check within "
        "probe_timeout_s), and keep a prefill worker whose advertised KV (UCX) listener it "
        "cannot open a TCP connection to out of rotation; false only where a firewall lets the "
        "decode workers, not the router, reach the KV listeners",
    )

    @model_validator(mode="after")
    def _order(self) -> RegistryConfig:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or every worker is evicted between two heartbeats"
            )
        if self.forget_after_s < self.heartbeat_timeout_s:
            raise ValueError("forget_after_s must be at least heartbeat_timeout_s")
        return self


class HttpConfig(_Frozen):
    """The OpenAI-compatible HTTP front (http_server.py), on the router's event loop."""

    port: int | None = Field(
        None, ge=0, le=65535, description="HTTP port; None: no HTTP front, 0: a free one"
    )
    host: str | None = Field(None, min_length=1, description="address to bind; None: server.host")
    tls: TlsServerConfig | None = Field(
        None, description="serve HTTPS with these PEM files; None: server.tls (plain HTTP if unset)"
    )


class RouterConfig(_Frozen):
    model_path: str = Field(
        min_length=1, description="checkpoint folder: tokenizer.json and config.json"
    )
    model_name: str | None = Field(
        None, min_length=1, description="name in GetServerInfo; None: the folder name"
    )
    max_model_len: int | None = Field(
        None, gt=1, description="None: the model's max_position_embeddings"
    )
    server: ServerConfig = ServerConfig()
    workers: WorkersConfig = WorkersConfig()
    workers_tls: TlsClientConfig | None = Field(
        None,
        description="TLS of the router's calls to workers (whom it trusts; cert_file + key_file "
        "for workers that require mutual TLS); None: plaintext",
    )
    routing: RoutingConfig = RoutingConfig()
    registry: RegistryConfig = RegistryConfig()
    http: HttpConfig = HttpConfig()
    auth: AuthConfig = AuthConfig()
    control: ControlConfig = ControlConfig()
    max_request_bytes: int = Field(
        8 * 2**20,
        gt=0,
        description="largest GenerateRequest taken (serialized); the HTTP front takes bodies of "
        "up to this plus 64 KiB for the JSON around the prompt (413 beyond)",
    )
    max_request_id_len: int = Field(
        256, gt=0, le=1000, description="longest request id a client may send (workers take 1024)"
    )
    max_prompt_bytes: int = Field(
        2**20,
        gt=0,
        description="largest prompt text (UTF-8 bytes) taken for tokenization; on the OpenAI "
        "front, the messages' content of a chat request in total (checked before the template)",
    )
    max_stop_strings: int = Field(
        16, gt=0, le=MAX_STOP_STRINGS, description="stop strings per request (workers take 64)"
    )
    max_stop_string_chars: int = Field(
        256,
        gt=0,
        le=MAX_STOP_STRING_CHARS,
        description="characters per stop string (workers take 1024)",
    )
    worker_call_timeout_s: float = Field(
        5.0, gt=0, description="Abort / ReleaseLease calls to workers"
    )

    @field_validator("routing")
    @classmethod
    def _colocated_has_no_prefill(cls, v: RoutingConfig, info: ValidationInfo) -> RoutingConfig:
        workers = info.data.get("workers")
        if v.colocated and workers is not None and workers.prefill:
            raise ValueError(
                f"colocated mode sends no prefills, but workers.prefill lists {list(workers.prefill)}; "
                "drop the prefill workers or routing.colocated"
            )
        return v

    @model_validator(mode="after")
    def _workers_only_fields(self) -> RouterConfig:
        if self.server.open_to_all:
            raise ValueError(
                "server.open_to_all is a worker setting; the router's callers are governed by "
                "auth.require_api_key"
            )
        return self

    @model_validator(mode="after")
    def _request_fits_transport(self) -> RouterConfig:
        if self.max_request_bytes > self.server.max_message_mb * 2**20:
            raise ValueError(
                f"max_request_bytes ({self.max_request_bytes}) exceeds server.max_message_mb "
                f"({self.server.max_message_mb} MiB); gRPC would refuse such requests first"
            )
        return self

    @classmethod
    def load(
        cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None
    ) -> RouterConfig:
        """YAML file (optional) with dotted-key overrides on top, e.g. {"routing.decode_policy": "round_robin"}."""
        return load_config(cls, path, overrides)
