"""Who is calling, and what they may do: API keys on the public APIs, the cluster secret on
RouterControl, admin rights (docs/security.md).

    Authenticator(cfg)                    keys read once at start-up (a bad file: one line)
      .caller(authorization, peer_host)   -> Caller, or RequestError(UNAUTHENTICATED)
      .check_cluster(authorization, ...)  RouterControl: the cluster secret, or PERMISSION_DENIED

A Caller's `scope` is what request ids belong to (frontend.py): the key's fingerprint when the
caller sent a key, else the peer's address without its port (a new connection changes the port,
not the caller; clients behind one proxy or NAT share a scope: use keys to tell them apart).
Keys are compared in constant time and never logged; a fingerprint is a 48-bit blake2b of the key.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from splitserve.request.errors import RequestError
from splitserve.router.config import RouterConfig
from splitserve.service.credentials import (
    bearer,
    cluster_secret,
    is_loopback_host,
    load_keys,
    match_key,
)

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"


@dataclass(frozen=True)
class Caller:
    scope: str  # request ids are unique per scope; Abort reaches only its own scope
    admin: bool = False


def fingerprint(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=6).hexdigest()


def grpc_peer_host(peer: str) -> str:
    """The address of a grpc peer string without its port: 'ipv4:1.2.3.4:5' -> '1.2.3.4',
    'ipv6:[::1]:5' -> '::1', 'unix:/path' -> 'unix:/path'."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


class Authenticator:
    def __init__(self, cfg: RouterConfig) -> None:
        a = cfg.auth
        self.admin_keys = load_keys(a.admin_keys_file, a.admin_keys_env, "admin key")
        self.api_keys = tuple(
            dict.fromkeys(load_keys(a.api_keys_file, a.api_keys_env) + self.admin_keys)
        )
        self.cluster_secret = cluster_secret(a.cluster_secret_file)
        hosts = [cfg.server.host]
        if cfg.http.port is not None:
            hosts.append(cfg.http.host or cfg.server.host)
        self.loopback_only = all(is_loopback_host(h) for h in hosts)
        if a.require_api_key is True and not self.api_keys:
            raise ValueError(
                "auth.require_api_key is true but no API key is configured; set auth.api_keys_file "
                f"or ${a.api_keys_env}"
            )
        if a.require_api_key == "auto" and not self.api_keys and not self.loopback_only:
            raise ValueError(
                f"the router listens on {', '.join(hosts)} (beyond this machine) without API keys; "
                f"give --api-keys-file (auth.api_keys_file) or ${a.api_keys_env}, or --no-api-key "
                "(auth.require_api_key: false) to serve everyone who can reach the port"
            )
        self.keys_required = bool(self.api_keys) and a.require_api_key is not False
        open_control = cfg.control.port is not None and self.cluster_secret is None
        if open_control and not is_loopback_host(cfg.control.host):
            log.warning(
                "the control listener on %s takes worker registrations from anyone who reaches "
                "it (no cluster secret); keep it on a private network or set "
                "SPLITSERVE_CLUSTER_SECRET",
                cfg.control.host,
            )

    @property
    def open_dev_mode(self) -> bool:
        """No keys at all and reachable from this machine only: everyone is trusted."""
        return not self.api_keys and self.loopback_only

    def caller(self, authorization: str | None, peer_host: str) -> Caller:
        token = bearer(authorization)
        if token is not None:
            key = match_key(token, self.api_keys)
            if key is not None:
                admin = match_key(token, self.admin_keys) is not None
                return Caller(f"key:{fingerprint(key)}", admin)
            if self.keys_required or self.api_keys:
                raise RequestError.unauthenticated(
                    "the API key is not valid; send a key this router was given "
                    "(authorization: Bearer <key>)"
                )
        elif self.keys_required:
            raise RequestError.unauthenticated(
                "an API key is required; send `authorization: Bearer <key>` (HTTP: the "
                "Authorization header, OpenAI clients: api_key)"
            )
        return Caller(f"peer:{peer_host}", admin=self.open_dev_mode)

    def admin_only(self, caller: Caller, what: str) -> None:
        if not caller.admin:
            raise RequestError.denied(f"{what} needs an admin key (auth.admin_keys_file)")

    def check_cluster(self, authorization: str | None, on_control_listener: bool) -> None:
        """RouterControl calls: the cluster secret when one is set; without one, only on the
        private control listener or a loopback-only router."""
        if self.cluster_secret is None:
            if on_control_listener or self.loopback_only:
                return
            raise RequestError.denied(
                "worker registration on the public port needs the cluster secret, and this router "
                "has none; set SPLITSERVE_CLUSTER_SECRET (or auth.cluster_secret_file) on the router "
                "and its workers, or register on a private control listener (control.port)"
            )
        token = bearer(authorization)
        if token is None or match_key(token, (self.cluster_secret.decode(),)) is None:
            raise RequestError.denied(
                "RouterControl needs this cluster's secret (`authorization: Bearer <secret>`, "
                "from SPLITSERVE_CLUSTER_SECRET / --cluster-secret-file on the worker side)"
            )
