"""What the deploy/k8s tests share: the manifests loaded once, each container's argv as the
kubelet runs it, parsed by the real entry point's argparse parser (running nothing), a
service's effective config (ConfigMap + flags, through the real pydantic models), and where a
container's file comes from in a Secret."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
POD_IP = "10.1.2.3"  # sample value for $(POD_IP)
ENTRYPOINT = ["splitserve"]  # the image's; a container without `command` runs it
SECRET = "splitserve-secrets"  # API keys, admin keys, cluster secret (kustomization.yaml)


def load_docs(folder: Path = K8S) -> list[tuple[str, dict]]:
    """(file name, document) of every manifest in `folder` (a copy with TLS on, in
    test_tls_deploy.py)."""
    return [
        (p.name, d)
        for p in sorted(folder.glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for d in yaml.safe_load_all(p.read_text())
        if d
    ]


DOCS = load_docs()
PODS = [(f"{f}/{d['metadata']['name']}", d) for f, d in DOCS if d["kind"] == "Deployment"]
CONTAINERS = [
    (f"{pid}/{c['name']}", dep, c)
    for pid, dep in PODS
    for c in (
        *dep["spec"]["template"]["spec"].get("initContainers", ()),
        *dep["spec"]["template"]["spec"]["containers"],
    )
]


def of_kind(kind: str, docs: list[tuple[str, dict]] | None = None) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in docs or DOCS if d["kind"] == kind}


def secret_keys(secret: str = SECRET) -> set[str]:
    """The keys of the Secret as the `kubectl create secret generic` in kustomization.yaml's
    header makes it."""
    header = "\n".join(
        line.removeprefix("#").strip()
        for line in (K8S / "kustomization.yaml").read_text().splitlines()
        if line.startswith("#")
    )
    command = re.search(rf"kubectl create secret generic {secret}((?:.*\\\n)*.*)", header)
    assert command, f"kustomization.yaml's header does not say how to create {secret}"
    argv = shlex.split(command[1].replace("\\\n", " "))
    keys = set()
    for a in argv:
        kind, _, value = a.partition("=")
        if kind == "--from-literal":  # KEY=VALUE
            keys.add(value.split("=", 1)[0])
        elif kind == "--from-file":  # [KEY=]PATH: the key is the file's name unless given
            keys.add(value.split("=", 1)[0] if "=" in value else Path(value).name)
    return keys


def secret_file(dep: dict, c: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in container `c`: through its volume mount, the
    pod's secret volume and that volume's items."""
    mount = next(
        (m for m in c.get("volumeMounts", ()) if path.startswith(m["mountPath"] + "/")), None
    )
    assert mount, f"{c['name']}: nothing mounted at {path}"
    assert mount.get("readOnly") is True, f"{c['name']}: {mount['mountPath']} not read-only"
    volume = next(
        v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    assert "secret" in volume, f"{c['name']}: {path} is not on a Secret volume"
    name = path.removeprefix(mount["mountPath"] + "/")
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", ())}
    assert not items or name in items, f"{c['name']}: {name} is not among the volume's items"
    return volume["secret"]["secretName"], items.get(name, name)


def container_argv(c: dict) -> list[str]:
    """command + args as the kubelet runs them: $(VAR) expanded from the container's env."""
    env = {
        e["name"]: POD_IP
        if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"
        else e.get("value", "")
        for e in c.get("env", ())
    }

    def expand(arg: str) -> str:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in env, (
                f"{c['name']}: $({var}) is not in its env, so Kubernetes passes it literally"
            )
        return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], arg)

    return [expand(a) for a in (*c.get("command", ENTRYPOINT), *c.get("args", ()))]


class _Parsed(Exception):
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns


def parse_argv(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """(program, Namespace) from the real argparse parser of the entry point, running nothing."""
    try:
        if argv[0] == "splitserve":
            from splitserve.cli.main import build_parser

            return "splitserve", build_parser().parse_args(argv[1:])
        assert argv[:2] == ["python", "-m"], f"{argv}: neither `splitserve` nor `python -m MODULE`"
        module = importlib.import_module(argv[2])
        assert "__main__" in Path(module.__file__).read_text(), f"{argv[2]} cannot run as python -m"
        original = argparse.ArgumentParser.parse_args

        def stop_after_parsing(self, args=None, namespace=None):
            raise _Parsed(original(self, args, namespace))

        # its main() builds the parser and parses; stop right there
        with pytest.MonkeyPatch.context() as mp, pytest.raises(_Parsed) as got:
            mp.setattr(argparse.ArgumentParser, "parse_args", stop_after_parsing)
            module.main(argv[3:])
        return argv[2], got.value.ns
    except SystemExit:
        raise AssertionError(f"`{' '.join(argv)}` does not parse") from None


def service_config(dep: dict, c: dict, ns: argparse.Namespace, tmp_path: Path, docs=None):
    """The service's effective config as its `run()` builds it: --config (read from the mounted
    ConfigMap) with the flags on top."""
    from splitserve.cli import decode_worker_cmd, prefill_worker_cmd, router_cmd
    from splitserve.decode_worker.config import load as load_decode
    from splitserve.prefill_worker.config import PrefillWorkerConfig
    from splitserve.router.config import RouterConfig

    module, load = {
        "router": (router_cmd, RouterConfig.load),
        "prefill-worker": (prefill_worker_cmd, PrefillWorkerConfig.load),
        "decode-worker": (decode_worker_cmd, load_decode),
    }[ns.command]
    path = None
    if ns.config:
        mount = next(m for m in c["volumeMounts"] if ns.config.startswith(m["mountPath"] + "/"))
        volume = next(
            v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
        )
        data = of_kind("ConfigMap", docs)[volume["configMap"]["name"]]["data"]
        path = tmp_path / ns.command
        path.write_text(data[ns.config.removeprefix(mount["mountPath"] + "/")])
    if ns.command == "router":
        return load(path, {field: getattr(ns, dest) for dest, field in module._OVERRIDES.items()})
    from splitserve.cli.worker_args import config_overrides

    return load(path, config_overrides(ns, module._OVERRIDES))
