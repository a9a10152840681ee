"""`splitserve serve --tls-cert-file --tls-key-file --tls-ca-file`: every child serves TLS with the
certificate, the router dials its workers trusting the CA, and serve's own health checks use
it; the three flags go together. No process starts: the plan (each child's argv, parsed by
the child's real command parser into its config) is read off the launcher."""

from __future__ import annotations

import argparse

import pytest

from splitserve.cli import decode_worker_cmd, prefill_worker_cmd, router_cmd, worker_args
from splitserve.cli.launcher import Launcher
from splitserve.cli.serve_args import add_arguments, client_tls
from splitserve.cli.serve_children import build
from splitserve.router.config import RouterConfig
from splitserve.service.tls import TlsClientConfig


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--port", "0", "--device", "cpu", *argv])


def _parse(command, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    return p.parse_args(["--host", "127.0.0.1", "--port", "1", *argv])


def test_every_child_serves_tls_and_the_router_trusts_the_ca(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths are made absolute for the children
    args = _args(
        *("--tls-cert-file", "server.pem", "--tls-key-file", "key.pem", "--tls-ca-file", "ca.pem")
    )
    tls = client_tls(args)
    assert tls == TlsClientConfig(ca_file="ca.pem")
    launcher = Launcher(tmp_path / "logs", tls=tls)
    build(launcher, args, tmp_path, 1, 1)
    assert [c.tls for c in launcher.children] == [tls] * 3  # health checks over TLS
    plan = {c.name: (c.args() if callable(c.args) else c.args) for c in launcher.children}
    served = {
        "cert_file": str(tmp_path / "server.pem"),
        "key_file": str(tmp_path / "key.pem"),
        "client_ca_file": None,
    }
    for name, command in (("prefill-0", prefill_worker_cmd), ("decode-0", decode_worker_cmd)):
        overrides = worker_args.config_overrides(_parse(command, plan[name]), {})
        assert {k: overrides[f"server.tls.{k}"] for k in served} == served, name
    router = _parse(router_cmd, plan["router"])
    cfg = RouterConfig.load(
        None, {field: getattr(router, dest) for dest, field in router_cmd._OVERRIDES.items()}
    )
    assert cfg.server.tls is not None and cfg.server.tls.model_dump() == served
    assert cfg.workers_tls == TlsClientConfig(ca_file=str(tmp_path / "ca.pem"))


def test_plaintext_without_the_flags_and_the_three_go_together(tmp_path):
    args = _args()
    assert client_tls(args) is None
    launcher = Launcher(tmp_path)
    build(launcher, args, tmp_path, 1, 1)
    for child in launcher.children:
        argv = child.args() if callable(child.args) else child.args
        assert not any(a.startswith(("--tls", "--workers-tls")) for a in argv), child.name
    with pytest.raises(ValueError, match="go together"):
        client_tls(_args("--tls-cert-file", "server.pem", "--tls-key-file", "key.pem"))
