"""TLS of the shared gRPC server and of its clients (service/tls.py), on a real grpc.aio server:
a client that trusts the CA is answered, one that trusts another CA or speaks plaintext is
refused; with client_ca_file only clients holding a certificate that CA signed get in; a bad
file is one line naming the setting before anything listens; the flags build the configs."""

from __future__ import annotations

import argparse
import asyncio
import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers_tls import make_pki

from splitserve.router.config import RouterConfig
from splitserve.service.grpc_service import GrpcServer, ServerConfig, channel_options
from splitserve.service.tls import (
    TlsClientConfig,
    TlsError,
    TlsServerConfig,
    client_ssl_context,
    open_channel,
    server_ssl_context,
)
from splitserve.service.tls_flags import add_client_tls_arguments, client_tls_from_args

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _check(address: str, tls: TlsClientConfig | None) -> int | grpc.StatusCode:
    """The health status a client with `tls` gets, or the status code of its failure."""
    async with open_channel(address, tls, channel_options()) as channel:
        try:
            got = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        except grpc.aio.AioRpcError as err:
            return err.code()
        return got.status


def _serve_and_check(tls: TlsServerConfig, clients: dict[str, TlsClientConfig | None]) -> dict:
    async def body():
        server = GrpcServer(ServerConfig(port=0, tls=tls))
        await server.start()
        try:
            await server.set_serving(True)
            return {name: await _check(server.address, c) for name, c in clients.items()}
        finally:
            await server.drain(0)

    return asyncio.run(body())


def test_server_tls_answers_who_trusts_its_ca_and_refuses_the_rest(pki):
    got = _serve_and_check(
        TlsServerConfig(cert_file=pki.server_cert, key_file=pki.server_key),
        {
            "trusts the CA": TlsClientConfig(ca_file=pki.ca),
            "by name": TlsClientConfig(ca_file=pki.ca, server_name_override="localhost"),
            "trusts another CA": TlsClientConfig(ca_file=pki.other_ca),
            "wrong name": TlsClientConfig(ca_file=pki.ca, server_name_override="elsewhere.test"),
            "plaintext": None,
        },
    )
    assert got == {
        "trusts the CA": SERVING,
        "by name": SERVING,
        "trusts another CA": grpc.StatusCode.UNAVAILABLE,
        "wrong name": grpc.StatusCode.UNAVAILABLE,
        "plaintext": grpc.StatusCode.UNAVAILABLE,
    }


def test_mutual_tls_admits_only_clients_with_a_certificate_from_the_client_ca(pki):
    got = _serve_and_check(
        TlsServerConfig(cert_file=pki.server_cert, key_file=pki.server_key, client_ca_file=pki.ca),
        {
            "with its cert": TlsClientConfig(
                ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key
            ),
            "no cert": TlsClientConfig(ca_file=pki.ca),
            "cert of another CA": TlsClientConfig(
                ca_file=pki.ca, cert_file=pki.other_client_cert, key_file=pki.other_client_key
            ),
        },
    )
    assert got == {
        "with its cert": SERVING,
        "no cert": grpc.StatusCode.UNAVAILABLE,
        "cert of another CA": grpc.StatusCode.UNAVAILABLE,
    }


def test_a_bad_file_is_one_line_naming_the_setting_before_anything_listens(pki, tmp_path):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    encrypted_like = tmp_path / "junk-key.pem"
    encrypted_like.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    cases = {
        "missing": (
            TlsServerConfig(cert_file=str(tmp_path / "nope.pem"), key_file=pki.server_key),
            r"^server\.tls\.cert_file: cannot read .*nope\.pem: No such file",
        ),
        "not PEM": (
            TlsServerConfig(cert_file=pki.server_cert, key_file=str(not_pem)),
            r"^server\.tls\.key_file: .*not\.pem holds no PEM block",
        ),
        "key of another cert": (
            TlsServerConfig(cert_file=pki.server_cert, key_file=pki.client_key),
            r"^server\.tls: .*server\.pem and .*client-key\.pem are not a certificate and its",
        ),
        "broken key": (
            TlsServerConfig(cert_file=pki.server_cert, key_file=str(encrypted_like)),
            r"^server\.tls: .* are not a certificate and its unencrypted private key",
        ),
        "CA not a certificate": (
            TlsServerConfig(
                cert_file=pki.server_cert, key_file=pki.server_key, client_ca_file=pki.client_key
            ),
            r"^server\.tls\.client_ca_file: .*client-key\.pem is not a PEM CA certificate",
        ),
    }

    async def start(tls: TlsServerConfig) -> None:
        server = GrpcServer(ServerConfig(port=0, tls=tls))
        try:
            await server.start()
        finally:
            assert server.port is None  # nothing was bound
            await server.drain(0)

    for name, (tls, pattern) in cases.items():
        with pytest.raises(TlsError, match=pattern) as err:
            asyncio.run(start(tls))
        assert "\n" not in str(err.value), name
    with pytest.raises(TlsError, match=r"^http\.tls\.cert_file: cannot read"):
        server_ssl_context(
            TlsServerConfig(cert_file=str(tmp_path / "nope.pem"), key_file=pki.server_key)
        )
    with pytest.raises(TlsError, match=r"^tls\.ca_file: .*not\.pem holds no PEM block"):
        open_channel("127.0.0.1:1", TlsClientConfig(ca_file=str(not_pem)))


def test_renewed_files_are_read_by_the_next_channel(pki, tmp_path):
    """Credentials are built from the files at each channel, so a rotated CA takes effect."""
    ca = tmp_path / "ca.pem"
    shutil.copy(pki.other_ca, ca)
    tls = TlsClientConfig(ca_file=str(ca))
    server_tls = TlsServerConfig(cert_file=pki.server_cert, key_file=pki.server_key)

    async def body():
        server = GrpcServer(ServerConfig(port=0, tls=server_tls))
        await server.start()
        try:
            await server.set_serving(True)
            before = await _check(server.address, tls)
            shutil.copy(pki.ca, ca)
            return before, await _check(server.address, tls)
        finally:
            await server.drain(0)

    assert asyncio.run(body()) == (grpc.StatusCode.UNAVAILABLE, SERVING)


def test_ssl_contexts_for_the_http_front_and_its_clients(pki):
    server = server_ssl_context(
        TlsServerConfig(cert_file=pki.server_cert, key_file=pki.server_key, client_ca_file=pki.ca)
    )
    assert server.verify_mode.name == "CERT_REQUIRED"
    client = client_ssl_context(
        TlsClientConfig(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    )
    assert client.check_hostname and client.verify_mode.name == "CERT_REQUIRED"
    assert [c["subject"] for c in client.get_ca_certs()] == [
        ((("commonName", "splitserve test CA"),),)
    ]


def _client_flags(*argv: str):
    p = argparse.ArgumentParser()
    add_client_tls_arguments(p)
    return client_tls_from_args(p.parse_args(list(argv)))


def test_client_flags(pki):
    assert _client_flags() is None  # no flag: plaintext
    assert _client_flags("--tls") == TlsClientConfig()  # TLS with the system's CAs
    assert _client_flags(
        "--tls-ca-file",
        pki.ca,
        "--tls-cert-file",
        pki.client_cert,
        "--tls-key-file",
        pki.client_key,
    ) == TlsClientConfig(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    with pytest.raises(ValueError, match=r"^--tls-cert-file/--tls-key-file: .*go together"):
        _client_flags("--tls-cert-file", pki.client_cert)
    with pytest.raises(ValueError, match=r"^--tls-ca-file: "):
        _client_flags("--tls-ca-file", "")


def test_router_and_worker_flags_reach_the_config(pki):
    from splitserve.cli import router_cmd, worker_args

    p = argparse.ArgumentParser()
    router_cmd.add_arguments(p)
    args = p.parse_args(
        [
            *("--model", "m", "--tls-cert-file", pki.server_cert, "--tls-key-file"),
            *(pki.server_key, "--workers-tls-ca-file", pki.ca),
            *("--workers-tls-cert-file", pki.client_cert, "--workers-tls-key-file", pki.client_key),
        ]
    )
    overrides = {field: getattr(args, dest) for dest, field in router_cmd._OVERRIDES.items()}
    cfg = RouterConfig.load(None, overrides)
    assert cfg.server.tls == TlsServerConfig(cert_file=pki.server_cert, key_file=pki.server_key)
    assert cfg.workers_tls == TlsClientConfig(
        ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key
    )
    assert cfg.http.tls is None  # the HTTP front falls back to server.tls (http_server.py)

    p = argparse.ArgumentParser()
    worker_args.add_shared_arguments(p, "PrefillWorkerConfig")
    args = p.parse_args(
        ["--tls-cert-file", "c.pem", "--tls-key-file", "k.pem", "--tls-client-ca-file", "ca.pem"]
    )
    assert {
        k: v
        for k, v in worker_args.config_overrides(args, {}).items()
        if k.startswith("server.tls")
    } == {
        "server.tls.cert_file": "c.pem",
        "server.tls.key_file": "k.pem",
        "server.tls.client_ca_file": "ca.pem",
    }
