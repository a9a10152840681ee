"""The router's access settings: API keys, admin keys, the cluster secret, per-caller limits,
and the private control listener (docs/security.md says how to use them).

YAML:

    auth:
      api_keys_file: /run/secrets/api-keys      # one key per line; also $SPLITSERVE_API_KEYS
      admin_keys_file: /run/secrets/admin-keys  # also $SPLITSERVE_ADMIN_KEYS
      cluster_secret_file: /run/secrets/cluster # also $SPLITSERVE_CLUSTER_SECRET(_FILE)
      require_api_key: auto                     # auto | true | false
      rate_per_s: 20                            # per caller; null: no rate limit
      burst: 40
      max_concurrent: 64                        # per caller; null: none
    control: {host: 10.0.0.2, port: 50052}      # RouterControl on its own listener
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AuthConfig(_Frozen):
    api_keys_file: str | None = Field(
        None, min_length=1, description="file of API keys, one per line ('#' comments)"
    )
    api_keys_env: str = Field(
        "SPLITSERVE_API_KEYS",
        min_length=1,
        description="environment variable of API keys, comma-separated",
    )
    admin_keys_file: str | None = Field(
        None,
        min_length=1,
        description="file of admin keys: also API keys, and may see worker addresses, abort any "
        "request and read /metrics on the HTTP port",
    )
    admin_keys_env: str = Field("SPLITSERVE_ADMIN_KEYS", min_length=1)
    cluster_secret_file: str | None = Field(
        None,
        min_length=1,
        description="the secret workers present to RegisterWorker / Heartbeat; None: "
        "$SPLITSERVE_CLUSTER_SECRET_FILE or $SPLITSERVE_CLUSTER_SECRET",
    )
    require_api_key: Literal["auto"] | bool = Field(
        "auto",
        description="auto: required when keys are configured; with none, the router refuses to "
        "start on a non-loopback address (set keys, or false to serve everyone who reaches it)",
    )
    rate_per_s: float | None = Field(
        None, gt=0, description="requests per second per caller (token bucket); None: no limit"
    )
    burst: int = Field(20, ge=1, description="requests a caller may send at once above rate_per_s")
    max_concurrent: int | None = Field(
        None, ge=1, description="in-flight requests per caller; None: no limit"
    )


class ControlConfig(_Frozen):
    """RouterControl (worker registration, heartbeats) on a listener of its own; unset port: on
    the public port, where it needs the cluster secret (or a loopback-only router)."""

    host: str = Field("127.0.0.1", min_length=1, description="address to bind")
    port: int | None = Field(
        None, ge=0, le=65535, description="control port; None: on the public port, 0: a free one"
    )
