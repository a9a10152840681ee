"""The API key a client sends to the router (docs/security.md): `authorization: Bearer <key>` as
gRPC metadata, `Authorization: Bearer <key>` as an HTTP header.

    add_api_key_argument(parser, openai=False)   --api-key
    api_key_from_args(args, openai=False)        --api-key, else $SPLITSERVE_API_KEY, else (openai
                                                 backend) $OPENAI_API_KEY; None: send none
    grpc_metadata(key)                           per-call metadata for a sync stub, or None
    grpc_interceptors(key)                       grpc.aio client interceptors adding it to every call
    http_headers(key)                            {"Authorization": "Bearer KEY"}, or {}

The environment is read when the command runs, not when the parser is built, so `--help` never
shows a key. A router without keys on loopback accepts any key (or none); otherwise an unknown
or missing key is UNAUTHENTICATED / HTTP 401.
"""

from __future__ import annotations

import argparse
import os

from splitserve.service.cluster_auth import bearer_interceptors

API_KEY_ENV = "SPLITSERVE_API_KEY"
OPENAI_API_KEY_ENV = "OPENAI_API_KEY"
AUTHORIZATION = "authorization"


def add_api_key_argument(p: argparse.ArgumentParser, openai: bool = False) -> None:
    env = f"${API_KEY_ENV}" + (f", else ${OPENAI_API_KEY_ENV} (--backend openai)" if openai else "")
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"the router's API key, sent as `authorization: Bearer KEY` (default {env}; the "
        "variable keeps it out of `ps`); a loopback router without keys needs none",
    )


def api_key_from_args(args: argparse.Namespace, openai: bool = False) -> str | None:
    key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV)
    if not key and openai:
        key = os.environ.get(OPENAI_API_KEY_ENV)
    key = (key or "").strip()
    return key or None


def _bearer(key: str) -> str:
    return f"Bearer {key}"


def grpc_metadata(key: str | None) -> tuple[tuple[str, str], ...] | None:
    return ((AUTHORIZATION, _bearer(key)),) if key else None


def http_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": _bearer(key)} if key else {}


def grpc_interceptors(key: str | None) -> list | None:
    """For `open_channel(..., interceptors=...)` (service/tls.py); None without a key."""
    return bearer_interceptors(key) if key else None
