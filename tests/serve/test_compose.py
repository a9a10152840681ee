"""compose.yaml without a docker engine: the services, GPU reservations, health checks, the
model volume, Prometheus scraping every metrics port, and every command (service and health
check) parsed by the real `splitserve` CLI parser. The keys wiring: the `keys` service's real
`keygen` writes the files the router reads, with which the real Authenticator lets the router
start (and without which it refuses to), the workers hold the cluster secret, and the header's
commands read the key and send it."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ("prefill", "decode")
SPLITSERVE = ("router", *WORKERS)
SECRETS = "/secrets"  # where the `secrets` volume is mounted
KEY_FLAGS = ("api_keys_file", "admin_keys_file", "cluster_secret_file")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _expand(arg: str) -> str:
    """${VAR:-default} -> default (compose's interpolation with nothing set)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)


def parse(argv: list[str]) -> argparse.Namespace:
    """`splitserve ARGV` through cli/main.py when it registers the subcommand, else through the
    subcommand module's own register() (commands that main.py does not list yet)."""
    from splitserve.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a.choices, dict))
    if argv[0] not in sub.choices:
        module = importlib.import_module(f"splitserve.cli.{argv[0].replace('-', '_')}_cmd")
        parser = argparse.ArgumentParser(prog="splitserve")
        module.register(parser.add_subparsers(dest="command", required=True))
    try:
        return parser.parse_args([_expand(a) for a in argv])
    except SystemExit:
        raise AssertionError(f"`splitserve {' '.join(argv)}` does not parse") from None


def test_services_and_top_level(compose):
    assert {*SPLITSERVE, "prometheus", "model"} <= set(compose["services"])
    assert "models" in compose["volumes"]
    assert (ROOT / "Dockerfile").is_file()
    assert 'ENTRYPOINT ["splitserve"]' in (ROOT / "Dockerfile").read_text()
    for name in (*SPLITSERVE, "model"):
        svc = compose["services"][name]
        assert svc["image"] == "splitserve:latest" and svc["build"]["context"] == "."
        assert "models:/models" in svc["volumes"], name


def test_every_command_parses(compose):
    parsed = {name: parse(compose["services"][name]["command"]) for name in (*SPLITSERVE, "model")}
    for name in SPLITSERVE:
        args = parsed[name]
        assert args.model == "/models/tiny" and args.host == "0.0.0.0" and args.metrics_port, name
    for name in WORKERS:
        assert parsed[name].device == "cuda" and parsed[name].advertise_host == name
    router = parsed["router"]
    assert router.prefill == [f"prefill:{parsed['prefill'].port}"]
    assert router.decode == [f"decode:{parsed['decode'].port}"]
    assert parsed["model"].folder == "/models/tiny"
    config = compose["services"]["prefill"]["configs"][0]
    assert parsed["prefill"].config == config["target"]
    assert (ROOT / compose["configs"][config["source"]]["file"]).is_file()


def test_prefill_config_loads_and_exposes_kv_port(compose):
    from splitserve.prefill_worker.config import PrefillWorkerConfig

    cfg = PrefillWorkerConfig.load(
        ROOT / "deploy" / "prefill-worker.yaml", {"engine.model_path": "/models/tiny"}
    )
    assert str(cfg.kv_transfer.listen_port) in compose["services"]["prefill"]["expose"]


def test_health_checks(compose):
    for name in SPLITSERVE:
        svc = compose["services"][name]
        hc = svc["healthcheck"]
        assert hc["test"][0] == "CMD" and hc["test"][1] == "splitserve"
        assert {"interval", "timeout", "retries", "start_period"} <= set(hc)
        args = parse(hc["test"][2:])
        assert args.command == "health"
        served = parse(svc["command"])
        assert args.address == f"127.0.0.1:{served.port}", name
        assert args.service.startswith("splitserve.v1."), name


def test_gpu_reservations(compose):
    for name in WORKERS:
        devices = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
    assert "deploy" not in compose["services"]["router"]  # the router needs no GPU


def test_prometheus_scrapes_every_metrics_port(compose):
    prom = compose["services"]["prometheus"]
    assert any(v.startswith("./deploy/prometheus.yml:") for v in prom["volumes"])
    doc = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {
        t for job in doc["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    want = {
        f"{name}:{parse(compose['services'][name]['command']).metrics_port}" for name in SPLITSERVE
    }
    assert targets == want


def test_router_metrics_port_is_not_published(compose):
    router = parse(compose["services"]["router"]["command"])
    published = {p.rsplit(":", 1)[-1] for p in compose["services"]["router"]["ports"]}
    assert str(router.port) in published and str(router.metrics_port) not in published
    assert str(router.metrics_port) in compose["services"]["router"]["expose"]


def test_keys_service_writes_what_the_router_and_workers_read(compose):
    services = compose["services"]
    keys = services["keys"]
    assert keys["image"] == "splitserve:latest" and keys["restart"] == "no"
    assert keys["volumes"] == [f"secrets:{SECRETS}"]  # the only service that writes there
    assert "secrets" in compose["volumes"]
    made = parse(keys["command"])
    assert made.command == "keygen" and all(f.startswith(SECRETS + "/") for f in made.files)
    router = parse(services["router"]["command"])
    assert {getattr(router, flag) for flag in KEY_FLAGS} <= set(made.files)
    for name in SPLITSERVE:
        assert f"secrets:{SECRETS}:ro" in services[name]["volumes"], name
        assert services[name]["depends_on"]["keys"] == {
            "condition": "service_completed_successfully"
        }, name
    for name in WORKERS:  # workers take calls only from holders of the router's cluster secret
        env = services[name]["environment"]
        assert env["SPLITSERVE_CLUSTER_SECRET_FILE"] == router.cluster_secret_file, name


def test_router_starts_with_the_generated_keys_and_refuses_without(compose, tmp_path, monkeypatch):
    from splitserve.cli import keygen_cmd, router_cmd
    from splitserve.router.auth import Authenticator
    from splitserve.router.config import RouterConfig

    def local(path: str) -> str:  # the volume, here
        return str(tmp_path / Path(path).relative_to(SECRETS))

    made = parse(compose["services"]["keys"]["command"])
    assert keygen_cmd.run(argparse.Namespace(files=[local(f) for f in made.files])) == 0
    args = parse(compose["services"]["router"]["command"])
    for flag in KEY_FLAGS:
        setattr(args, flag, local(getattr(args, flag)))
    for var in ("SPLITSERVE_API_KEYS", "SPLITSERVE_ADMIN_KEYS"):
        monkeypatch.delenv(var, raising=False)

    def config(ns: argparse.Namespace) -> RouterConfig:
        return RouterConfig.load(
            None, {field: getattr(ns, dest) for dest, field in router_cmd._OVERRIDES.items()}
        )

    auth = Authenticator(config(args))
    assert auth.keys_required and len(auth.admin_keys) == 1 and auth.cluster_secret
    assert not auth.open_dev_mode  # bound to 0.0.0.0: no caller is trusted without a key
    for flag in KEY_FLAGS:
        setattr(args, flag, None)
    with pytest.raises(ValueError, match="without API keys"):
        Authenticator(config(args))


def test_header_reads_the_key_and_sends_it(compose):
    header = [
        line.removeprefix("#").strip()
        for line in (ROOT / "compose.yaml").read_text().splitlines()
        if line.startswith("#")
    ]
    router = parse(compose["services"]["router"]["command"])
    read = [line for line in header if "docker compose exec" in line]
    assert read == ["KEY=$(docker compose exec -T router cat " + router.api_keys_file + ")"]
    prefix = ["docker", "compose", "run", "--rm", "router"]
    (run,) = [shlex.split(line) for line in header if line.startswith(" ".join(prefix))]
    assert run[: len(prefix)] == prefix
    sent = parse(run[len(prefix) :])
    assert sent.command == "generate" and sent.api_key == "$KEY"
    assert sent.address == f"router:{router.port}"
    assert any('-H "Authorization: Bearer $KEY"' in line for line in header)
