"""deploy/k8s's access wiring without a cluster: the router reads its API keys, admin keys and
cluster secret from the Secret that kustomization.yaml's header creates, and starts with them
(the real Authenticator on its effective config; without them it refuses to), and serves
RouterControl on a private control port that only the headless Service names."""

from __future__ import annotations

from pathlib import Path

import pytest
from k8s_helpers import PODS, container_argv, of_kind, parse_argv, secret_file, service_config


def _router() -> tuple[dict, dict]:
    """The router's Deployment and its main container."""
    (dep,) = [d for _, d in PODS if d["metadata"]["name"] == "splitserve-router"]
    return dep, dep["spec"]["template"]["spec"]["containers"][0]


def test_control_port_only_in_the_headless_service(tmp_path):
    router_dep, main = _router()
    cfg = service_config(router_dep, main, parse_argv(container_argv(main))[1], tmp_path)
    control = {p["name"] for p in main["ports"] if p["containerPort"] == cfg.control.port}
    services = of_kind("Service")
    exposing = {
        name
        for name, svc in services.items()
        for p in svc["spec"]["ports"]
        if p["targetPort"] in control or p["targetPort"] == cfg.control.port
    }
    assert exposing == {"splitserve-router-control"}
    headless = services["splitserve-router-control"]["spec"]
    assert headless["clusterIP"] == "None" and len(headless["ports"]) == 1
    public = services["splitserve-router"]["spec"]
    assert {p["port"] for p in public["ports"]} >= {cfg.server.port, cfg.http.port}


def test_router_starts_with_the_secret_and_refuses_without_it(tmp_path, monkeypatch):
    """The real Authenticator on the effective router config, the Secret's files written as
    the header's command makes them: keys required, a cluster secret, the control listener.
    Without the key files the same config (bound beyond loopback) is refused at start."""
    from splitserve.cli.keygen_cmd import write_new_key
    from splitserve.router.auth import Authenticator

    router_dep, main = _router()
    cfg = service_config(router_dep, main, parse_argv(container_argv(main))[1], tmp_path)
    files = {}
    for field in ("api_keys_file", "admin_keys_file", "cluster_secret_file"):
        _, key = secret_file(router_dep, main, getattr(cfg.auth, field))
        files[field] = str(tmp_path / "secret" / key)
        write_new_key(Path(files[field]))
    auth = Authenticator(cfg.model_copy(update={"auth": cfg.auth.model_copy(update=files)}))
    assert auth.keys_required and auth.admin_keys and auth.cluster_secret is not None
    assert cfg.control.port is not None and not auth.loopback_only and not auth.open_dev_mode
    bare = cfg.auth.model_copy(
        update={"api_keys_file": None, "admin_keys_file": None, "cluster_secret_file": None}
    )
    for var in (bare.api_keys_env, bare.admin_keys_env):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="without API keys"):
        Authenticator(cfg.model_copy(update={"auth": bare}))


def test_public_service_exposes_neither_metrics_nor_control_port(tmp_path):
    """The Service clients reach (not headless: it load-balances, and an Ingress or a
    LoadBalancer points at it) names the router's gRPC and HTTP ports and nothing else: not the
    metrics port (no key) nor the control port (worker registration), by number or by name."""
    router_dep, main = _router()
    cfg = service_config(router_dep, main, parse_argv(container_argv(main))[1], tmp_path)
    named = {p["name"]: p["containerPort"] for p in main["ports"]}
    private = {cfg.server.metrics_port, cfg.control.port}
    assert None not in private and private <= set(named.values())
    selects_router = [
        (name, svc)
        for name, svc in of_kind("Service").items()
        if svc["spec"]["selector"].items()
        <= router_dep["spec"]["template"]["metadata"]["labels"].items()
    ]
    public = [(n, s) for n, s in selects_router if s["spec"].get("clusterIP") != "None"]
    assert [n for n, _ in public] == ["splitserve-router"], public
    ((_, svc),) = public
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"  # exposed on purpose, by an Ingress
    targets = {named.get(p["targetPort"], p["targetPort"]) for p in svc["spec"]["ports"]}
    ports = {p["port"] for p in svc["spec"]["ports"]}
    assert not (targets | ports) & private, (targets, ports, private)
    assert targets == ports == {cfg.server.port, cfg.http.port}
