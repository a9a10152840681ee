"""TLS for every splitserve connection: the config models, the credentials built from their PEM
files, and the one way to open a gRPC channel (docs/tls.md says how to make and mount the files).

    TlsServerConfig(cert_file, key_file, client_ca_file=None)
                                    a server's certificate; with client_ca_file, mutual TLS:
                                    a client must present a certificate that CA signed
    TlsClientConfig(ca_file, cert_file, key_file, server_name_override)
                                    what a client trusts (ca_file; None: the system's roots) and
                                    shows (cert_file + key_file, for mutual TLS)
    server_credentials(cfg)         grpc.ServerCredentials      (GrpcServer.start)
    server_ssl_context(cfg)         ssl.SSLContext for a server  (the router's HTTP front)
    client_credentials(cfg)         grpc.ChannelCredentials
    client_ssl_context(cfg)         ssl.SSLContext for a client  (HTTP clients)
    open_channel(address, tls, options, aio=True)
                                    a grpc.aio (or, aio=False, a sync) channel: secure when `tls`
                                    is given, insecure when it is None

Files are read, parsed and matched (the key must belong to the certificate) when credentials are
built, so a wrong file is one TlsError line at start naming the setting and the file, not a
handshake that fails later for every peer. Files are read again for each new channel, so a
renewed certificate is used by the connections opened after the renewal.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator


class TlsError(ValueError):
    """A TLS file that cannot be read or used; one line naming the setting and the file."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TlsServerConfig(_Frozen):
    """A server's TLS: its certificate chain and key, and optionally the CA its clients' certs
    must be signed by (mutual TLS)."""

    cert_file: str = Field(
        min_length=1, description="PEM certificate chain (the server's own first)"
    )
    key_file: str = Field(min_length=1, description="PEM private key of cert_file")
    client_ca_file: str | None = Field(
        None,
        min_length=1,
        description="PEM CA bundle; set: mutual TLS, every client must present a certificate "
        "signed by it; None: any client may connect",
    )


class TlsClientConfig(_Frozen):
    """A client's TLS: whom it trusts and, for mutual TLS, the certificate it presents."""

    ca_file: str | None = Field(
        None,
        min_length=1,
        description="PEM CA bundle the server's certificate must chain to; None: the system's roots",
    )
    cert_file: str | None = Field(
        None, min_length=1, description="PEM client certificate chain (mutual TLS)"
    )
    key_file: str | None = Field(None, min_length=1, description="PEM private key of cert_file")
    server_name_override: str | None = Field(
        None,
        min_length=1,
        description="name checked against the server's certificate instead of the dialled host "
        "(a certificate without the IP or name that is dialled)",
    )

    @model_validator(mode="after")
    def _pair(self) -> TlsClientConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                "cert_file and key_file go together (mutual TLS needs both); give both or neither"
            )
        return self


def _read(path: str, setting: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise TlsError(f"{setting}: {path} holds no PEM block (-----BEGIN ...)")
    return data


def _no_password() -> bytes:
    # gRPC cannot use an encrypted key; without this, OpenSSL would prompt on the terminal
    return b""


def _load_pair(ctx: ssl.SSLContext, cert_file: str, key_file: str, setting: str) -> None:
    """Loads the pair into `ctx`; the key must belong to the certificate and be unencrypted
    (gRPC would only fail at the first handshake)."""
    try:
        ctx.load_cert_chain(cert_file, key_file, password=_no_password)
    except ssl.SSLError as exc:
        raise TlsError(
            f"{setting}: {cert_file} and {key_file} are not a certificate and its unencrypted "
            f"private key ({exc.reason or exc})"
        ) from None


def _check_pair(cert_file: str, key_file: str, setting: str) -> None:
    _load_pair(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), cert_file, key_file, setting)


def _check_ca(ca_file: str, setting: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise TlsError(
            f"{setting}: {ca_file} is not a PEM CA certificate ({exc.reason or exc})"
        ) from None


def server_credentials(cfg: TlsServerConfig, setting: str = "server.tls") -> grpc.ServerCredentials:
    key = _read(cfg.key_file, f"{setting}.key_file")
    cert = _read(cfg.cert_file, f"{setting}.cert_file")
    _check_pair(cfg.cert_file, cfg.key_file, setting)
    ca = None
    if cfg.client_ca_file is not None:
        ca = _read(cfg.client_ca_file, f"{setting}.client_ca_file")
        _check_ca(cfg.client_ca_file, f"{setting}.client_ca_file")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def server_ssl_context(cfg: TlsServerConfig, setting: str = "http.tls") -> ssl.SSLContext:
    for field in ("cert_file", "key_file"):
        _read(getattr(cfg, field), f"{setting}.{field}")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _load_pair(ctx, cfg.cert_file, cfg.key_file, setting)
    if cfg.client_ca_file is not None:
        _read(cfg.client_ca_file, f"{setting}.client_ca_file")
        _check_ca(cfg.client_ca_file, f"{setting}.client_ca_file")
        ctx.load_verify_locations(cafile=cfg.client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_credentials(cfg: TlsClientConfig, setting: str = "tls") -> grpc.ChannelCredentials:
    ca = key = cert = None
    if cfg.ca_file is not None:
        ca = _read(cfg.ca_file, f"{setting}.ca_file")
        _check_ca(cfg.ca_file, f"{setting}.ca_file")
    if cfg.cert_file is not None and cfg.key_file is not None:
        key = _read(cfg.key_file, f"{setting}.key_file")
        cert = _read(cfg.cert_file, f"{setting}.cert_file")
        _check_pair(cfg.cert_file, cfg.key_file, setting)
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def client_ssl_context(cfg: TlsClientConfig, setting: str = "tls") -> ssl.SSLContext:
    if cfg.ca_file is not None:
        _read(cfg.ca_file, f"{setting}.ca_file")
        _check_ca(cfg.ca_file, f"{setting}.ca_file")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.ca_file)
    if cfg.cert_file is not None and cfg.key_file is not None:
        _load_pair(ctx, cfg.cert_file, cfg.key_file, setting)
    return ctx


def open_channel(
    address: str,
    tls: TlsClientConfig | None = None,
    options: list[tuple[str, int | str]] | None = None,
    aio: bool = True,
    interceptors: list | None = None,
):
    """A channel to `address`: TLS with `tls`'s trust and identity when given, else plaintext.
    aio=True: a grpc.aio.Channel (async with / await close()); False: a sync grpc.Channel.
    `interceptors`: grpc.aio client interceptors (aio only; e.g. cluster_auth.client_interceptors)."""
    options = list(options or [])
    extra = {"interceptors": interceptors} if aio and interceptors else {}
    if tls is None:
        return (
            grpc.aio.insecure_channel(address, options=options, **extra)
            if aio
            else grpc.insecure_channel(address, options=options)
        )
    if tls.server_name_override is not None:
        options.append(("grpc.ssl_target_name_override", tls.server_name_override))
    creds = client_credentials(tls)
    return (
        grpc.aio.secure_channel(address, creds, options=options, **extra)
        if aio
        else grpc.secure_channel(address, creds, options=options)
    )
