"""The TLS flags of the command line, defined once (docs/tls.md).

A service's own certificate (router, prefill and decode workers) is three flags mapped onto its
config like every other flag (`server.tls.*`, so YAML may set them instead):

    add_server_tls_arguments(parser)    --tls-cert-file --tls-key-file --tls-client-ca-file
    SERVER_TLS_OVERRIDES                flag dest -> dotted config field

A client (generate, bench, health, the registration sidecar) says whom it trusts and, for
mutual TLS, what it presents:

    add_client_tls_arguments(parser)    --tls --tls-ca-file --tls-cert-file --tls-key-file
                                        --tls-server-name
    client_tls_from_args(args)          a TlsClientConfig, or None (plaintext) when no flag is given
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when used: the CLI's start stays light (no grpc, no pydantic)
    from splitserve.service.tls import TlsClientConfig

# TlsClientConfig field -> flag dest
_CLIENT_FLAGS = {
    "ca_file": "tls_ca_file",
    "cert_file": "tls_cert_file",
    "key_file": "tls_key_file",
    "server_name_override": "tls_server_name",
}
SERVER_TLS_OVERRIDES = {
    "tls_cert_file": "server.tls.cert_file",
    "tls_key_file": "server.tls.key_file",
    "tls_client_ca_file": "server.tls.client_ca_file",
}


def add_server_tls_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "TLS of this service's gRPC port (docs/tls.md; or server.tls in --config)"
    )
    g.add_argument("--tls-cert-file", metavar="PEM", help="serve TLS with this certificate chain")
    g.add_argument("--tls-key-file", metavar="PEM", help="the certificate's private key")
    g.add_argument(
        "--tls-client-ca-file",
        metavar="PEM",
        help="mutual TLS: accept only clients whose certificate this CA signed",
    )


def add_client_tls_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS to the server (docs/tls.md; plaintext when none is given)")
    g.add_argument(
        "--tls", action="store_true", help="use TLS, trusting the system's CAs (implied by --tls-*)"
    )
    g.add_argument("--tls-ca-file", metavar="PEM", help="trust server certificates this CA signed")
    g.add_argument(
        "--tls-cert-file", metavar="PEM", help="mutual TLS: present this client certificate"
    )
    g.add_argument("--tls-key-file", metavar="PEM", help="mutual TLS: the certificate's key")
    g.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="check the server's certificate for NAME instead of the dialled host",
    )


def client_tls_from_args(args: argparse.Namespace) -> TlsClientConfig | None:
    """The client TLS the flags ask for; None when none was given. ValueError (one line) when the
    flags do not fit together."""
    from pydantic import ValidationError

    from splitserve.service import tls

    values = {field: getattr(args, dest) for field, dest in _CLIENT_FLAGS.items()}
    if not args.tls and all(v is None for v in values.values()):
        return None
    try:
        return tls.TlsClientConfig(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        # a field's own error names its flag; the pairing check (no field) names both
        fields = [str(f) for f in err["loc"]] or ["cert_file", "key_file"]
        flags = [f"--{_CLIENT_FLAGS[f].replace('_', '-')}" for f in fields]
        msg = err["msg"].removeprefix("Value error, ")
        raise ValueError(f"{'/'.join(flags)}: {msg}") from None
