"""Secrets every service reads the same way: API keys, admin keys, the cluster secret.

    load_keys(file, env)         keys from a file (one per line, '#' comments) and/or an
                                 environment variable (comma-separated); order kept, no blanks
    cluster_secret(file)         the shared secret of one deployment's processes (worker
                                 registration with the router, TP control messages): the file
                                 given, else $SPLITSERVE_CLUSTER_SECRET_FILE, else
                                 $SPLITSERVE_CLUSTER_SECRET; None when none is set
    match_key(candidate, keys)   the key equal to `candidate`, compared in constant time
                                 (every key is compared, so the time tells nothing about which)
    is_loopback_host(host)       a bind address only this machine can reach

Secrets never appear in logs or errors; a missing or empty file is one clear line.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

CLUSTER_SECRET_ENV = "SPLITSERVE_CLUSTER_SECRET"
CLUSTER_SECRET_FILE_ENV = "SPLITSERVE_CLUSTER_SECRET_FILE"
MIN_SECRET_LEN = 16


class CredentialError(ValueError):
    """A secret that cannot be read or is too weak; the message says how to fix it."""


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise CredentialError(f"cannot read the {what} file {path}: {exc.strerror}") from None


def load_keys(file: str | None, env: str | None, what: str = "API key") -> tuple[str, ...]:
    """Keys from `file` and the environment variable `env`; duplicates dropped."""
    keys: list[str] = []
    if file:
        for line in _read(file, what).splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    if env and os.environ.get(env):
        keys.extend(k.strip() for k in os.environ[env].split(",") if k.strip())
    for key in keys:
        if len(key) < MIN_SECRET_LEN:
            raise CredentialError(
                f"an {what} is shorter than {MIN_SECRET_LEN} characters; use a random one "
                "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
    return tuple(dict.fromkeys(keys))


def cluster_secret(file: str | None = None) -> bytes | None:
    """The deployment's cluster secret, or None when none is configured."""
    path = file or os.environ.get(CLUSTER_SECRET_FILE_ENV)
    text = _read(path, "cluster secret").strip() if path else os.environ.get(CLUSTER_SECRET_ENV)
    if text is None or (not text and not path):
        return None
    if len(text) < MIN_SECRET_LEN:
        raise CredentialError(
            f"the cluster secret is shorter than {MIN_SECRET_LEN} characters; use a random one "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return text.encode()


def match_key(candidate: str, keys: Sequence[str]) -> str | None:
    """The key equal to `candidate` or None; every key is compared in constant time."""
    try:
        got = candidate.encode()
    except UnicodeEncodeError:  # an HTTP header's undecodable bytes (surrogate escapes): no key
        return None
    found = None
    for key in keys:
        if hmac.compare_digest(got, key.encode()):
            found = key
    return found


def bearer(value: str | None) -> str | None:
    """The token of an `authorization: Bearer <token>` value (scheme case-insensitive)."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def is_loopback_host(host: str) -> bool:
    """True for a bind address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
