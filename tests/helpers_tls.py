"""A throwaway PKI for the TLS tests (the `cryptography` package of the test extra): a CA, a
server certificate it signed for 127.0.0.1 / localhost, a client certificate it signed, and a
second, unrelated CA with a client certificate of its own (what a stranger would hold).

    pki = make_pki(tmp_path)
    pki.ca, pki.server_cert, pki.server_key, pki.client_cert, pki.client_key,
    pki.other_ca, pki.other_client_cert, pki.other_client_key      # PEM file paths (str)

Import it as `from helpers_tls import make_pki` (tests/ is on sys.path through its conftest.py).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str
    other_client_cert: str
    other_client_key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: x509.Name, key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _ca(cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(cn, _name(cn), key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(ca_key, ca_cert: x509.Certificate, cn: str, usage, sans=()):
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(cn, ca_cert.subject, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _write(directory: Path, name: str, key=None, cert=None) -> str:
    path = directory / name
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return str(path)


def make_pki(directory: str | Path) -> Pki:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca = _ca("splitserve test CA")
    server_sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_key, server = _leaf(
        ca_key, ca, "splitserve test server", ExtendedKeyUsageOID.SERVER_AUTH, server_sans
    )
    client_key, client = _leaf(ca_key, ca, "splitserve router", ExtendedKeyUsageOID.CLIENT_AUTH)
    other_key, other = _ca("someone else's CA")
    stranger_key, stranger = _leaf(other_key, other, "stranger", ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(
        ca=_write(d, "ca.pem", cert=ca),
        server_cert=_write(d, "server.pem", cert=server),
        server_key=_write(d, "server-key.pem", key=server_key),
        client_cert=_write(d, "client.pem", cert=client),
        client_key=_write(d, "client-key.pem", key=client_key),
        other_ca=_write(d, "other-ca.pem", cert=other),
        other_client_cert=_write(d, "other-client.pem", cert=stranger),
        other_client_key=_write(d, "other-client-key.pem", key=stranger_key),
    )
