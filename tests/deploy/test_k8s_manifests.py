"""deploy/k8s without a cluster: every manifest validates against the Kubernetes JSON schemas
(kubernetes-validate ships them, so this runs offline), the kustomization lists exactly the
folder's files, every container runs a real CLI whose flags parse, and what must agree does:
the effective service configs (ConfigMap + flags, loaded by the real pydantic models) against
the declared ports, probes, Prometheus annotations, drain grace and the registration sidecars."""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from splitserve.protos import generate_pb2, router_pb2, worker_pb2

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# 1.30: the oldest release we claim (native gRPC probes are GA since 1.27); plus the newest shipped
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
POD_IP = "10.1.2.3"  # sample value for $(POD_IP)
ENTRYPOINT = ["splitserve"]  # the image's; a container without `command` runs it
SHUTDOWN_MARGIN_S = 10  # after the drain: engine stop, UCX close, exit
# what each `splitserve` service registers in grpc.health.v1 ("" is the whole server)
HEALTH = {
    "router": {
        "",
        generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name,
        router_pb2.DESCRIPTOR.services_by_name["RouterControl"].full_name,
    },
    "prefill-worker": {"", worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name},
    "decode-worker": {"", worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name},
}
ROLE = {"prefill-worker": "prefill", "decode-worker": "decode"}


def _load_docs() -> list[tuple[str, dict]]:
    return [
        (p.name, d)
        for p in sorted(K8S.glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for d in yaml.safe_load_all(p.read_text())
        if d
    ]


DOCS = _load_docs()
PODS = [(f"{f}/{d['metadata']['name']}", d) for f, d in DOCS if d["kind"] == "Deployment"]
CONTAINERS = [
    (f"{pid}/{c['name']}", dep, c)
    for pid, dep in PODS
    for c in (
        *dep["spec"]["template"]["spec"].get("initContainers", ()),
        *dep["spec"]["template"]["spec"]["containers"],
    )
]


def _of_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == kind}


def _argv(c: dict) -> list[str]:
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


def _parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
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


def _config(dep: dict, c: dict, ns: argparse.Namespace, tmp_path: Path):
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
        data = _of_kind("ConfigMap")[volume["configMap"]["name"]]["data"]
        path = tmp_path / ns.command
        path.write_text(data[ns.config.removeprefix(mount["mountPath"] + "/")])
    if ns.command == "router":
        return load(path, {field: getattr(ns, dest) for dest, field in module._OVERRIDES.items()})
    from splitserve.cli.worker_args import config_overrides

    return load(path, config_overrides(ns, module._OVERRIDES))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schema(version):
    assert DOCS and {"Deployment", "Service", "ConfigMap"} <= {d["kind"] for _, d in DOCS}
    for name, doc in DOCS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            raise AssertionError(
                f"{name} {doc['kind']}/{doc['metadata']['name']}: "
                f"{'.'.join(map(str, err.path))}: {err.message}"
            ) from None


def test_kustomization_lists_exactly_the_folder_files():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    listed = kust["resources"]
    assert len(listed) == len(set(listed)), "a resource is listed twice"
    on_disk = {p.name for p in K8S.iterdir() if p.name != "kustomization.yaml"}
    assert set(listed) == on_disk, (
        f"missing from kustomization: {on_disk - set(listed)}; "
        f"listed but absent: {set(listed) - on_disk}"
    )


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_every_resource():
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    rendered = sorted(
        (d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout) if d
    )
    assert rendered == sorted((d["kind"], d["metadata"]["name"]) for _, d in DOCS)


def test_selectors_match_pod_labels():
    labels = [dep["spec"]["template"]["metadata"]["labels"] for _, dep in PODS]
    for _, dep in PODS:
        sel = dep["spec"]["selector"]["matchLabels"]
        assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items(), dep[
            "metadata"
        ]["name"]
    for name, svc in _of_kind("Service").items():
        pods = [
            dep
            for (_, dep), lab in zip(PODS, labels)
            if svc["spec"]["selector"].items() <= lab.items()
        ]
        assert pods, f"Service {name} selects no pod"
        ports = {
            p["name"]: p["containerPort"]
            for dep in pods
            for c in dep["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", ())
        }
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, (
                f"Service {name}: no container port named {p['targetPort']}"
            )
            assert ports[p["targetPort"]] == p["port"], (
                f"Service {name}: {p['name']} port differs from the pod's"
            )


@pytest.mark.parametrize("cid,dep,c", CONTAINERS, ids=[cid for cid, _, _ in CONTAINERS])
def test_every_container_runs_a_real_entry_point(cid, dep, c):
    assert c["image"] == "splitserve:latest"
    prog, ns = _parse(_argv(c))
    assert prog in ("splitserve", "splitserve.router.registration"), cid
    for p in c.get("ports", ()):
        assert len(p["name"]) <= 15 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", p["name"]), (
            p["name"]
        )


def test_dockerfile_entrypoint_is_splitserve():
    assert f"ENTRYPOINT {ENTRYPOINT}".replace("'", '"') in (ROOT / "Dockerfile").read_text()


@pytest.mark.parametrize("pid,dep", PODS, ids=[pid for pid, _ in PODS])
def test_pod_config_ports_probes_and_grace_agree(pid, dep, tmp_path):
    spec, meta = dep["spec"]["template"]["spec"], dep["spec"]["template"]["metadata"]
    main, *sidecars = spec["containers"]
    _, ns = _parse(_argv(main))
    cfg = _config(dep, main, ns, tmp_path)
    ports = {p["containerPort"] for p in main["ports"]}
    server = cfg.server
    # the kubelet probes and peers dial the pod IP: bind every interface, advertise the pod IP
    assert server.host == "0.0.0.0" and server.advertise_host == POD_IP, pid
    assert server.port in ports and server.metrics_port in ports, pid
    ann = meta["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics", pid
    assert int(ann["prometheus.io/port"]) == server.metrics_port, pid
    assert spec["terminationGracePeriodSeconds"] >= server.drain_grace_s + SHUTDOWN_MARGIN_S, pid

    probes = {kind: main[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    for kind, probe in probes.items():
        assert probe["grpc"]["port"] == server.port, f"{pid} {kind}"
        assert probe["grpc"].get("service", "") in HEALTH[ns.command], (
            f"{pid} {kind}: no such health service"
        )
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, (
        f"{pid}: startup allows too little"
    )

    # the model the initContainer writes is the one the service loads
    model = cfg.model_path if ns.command == "router" else cfg.engine.model_path
    writers = [_parse(_argv(c))[1] for c in spec.get("initContainers", ())]
    assert model in {w.folder for w in writers if w.command == "make-model"}, pid

    if ns.command == "router":
        control = router_pb2.DESCRIPTOR.services_by_name["RouterControl"].full_name
        # GenerateService is NOT_SERVING until workers register: never restart the router for it
        assert probes["livenessProbe"]["grpc"]["service"] == control
        assert probes["startupProbe"]["grpc"]["service"] == control
        assert cfg.http.port in ports and not cfg.workers.prefill and not cfg.workers.decode
        assert probes["readinessProbe"]["grpc"]["service"] != control
        assert not sidecars
        return

    role_service = worker_pb2.DESCRIPTOR.services_by_name[
        ROLE[ns.command].title() + "Worker"
    ].full_name
    assert probes["readinessProbe"]["grpc"]["service"] == role_service, pid
    assert ns.device == "cuda", pid
    for part in ("requests", "limits"):
        assert str(main.get("resources", {}).get(part, {}).get("nvidia.com/gpu")) == "1", (
            f"{pid}: GPU {part}"
        )
    if ns.command == "prefill-worker":
        assert cfg.kv_transfer.listen_port and cfg.kv_transfer.listen_port in ports, (
            "UCX port not fixed/declared"
        )

    (register,) = sidecars
    prog, reg = _parse(_argv(register))
    assert prog == "splitserve.router.registration"
    assert reg.role == ROLE[ns.command] and reg.worker == f"{POD_IP}:{server.port}", pid
    host, port = reg.router.rsplit(":", 1)
    svc = _of_kind("Service")[host]
    # the router is not ready before a worker registers: the sidecar must reach not-ready pods
    assert svc["spec"].get("publishNotReadyAddresses") is True, f"Service {host}"
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
    selected = [
        d["spec"]["template"]["spec"]["containers"][0]
        for _, d in PODS
        if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert selected and all(_parse(_argv(c))[1].command == "router" for c in selected), (
        f"Service {host}"
    )
