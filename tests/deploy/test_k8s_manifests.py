"""deploy/k8s without a cluster: every manifest validates against the Kubernetes JSON schemas
(kubernetes-validate ships them, so this runs offline), the kustomization lists exactly the
folder's files, every container runs a real CLI whose flags parse, and what must agree does:
the effective service configs (ConfigMap + flags, loaded by the real pydantic models) against
the declared ports, probes, Prometheus annotations, drain grace and the registration sidecars,
which register at the router's control port with the cluster secret the workers also hold
(the router's keys and control listener: test_k8s_access.py)."""

from __future__ import annotations

import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from k8s_helpers import (
    CONTAINERS,
    DOCS,
    ENTRYPOINT,
    K8S,
    POD_IP,
    PODS,
    ROOT,
    SECRET,
    container_argv,
    of_kind,
    parse_argv,
    secret_file,
    secret_keys,
    service_config,
)

from splitserve.protos import generate_pb2, router_pb2, worker_pb2

# 1.30: the oldest release we claim (native gRPC probes are GA since 1.27); plus the newest shipped
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
SHUTDOWN_MARGIN_S = 10  # after the drain: engine stop, UCX close, exit
CONTROL = router_pb2.DESCRIPTOR.services_by_name["RouterControl"].full_name
# what each `splitserve` service registers in grpc.health.v1 ("" is the whole server); the
# router's RouterControl is on its control port (below), not here
HEALTH = {
    "router": {"", generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name},
    "prefill-worker": {"", worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name},
    "decode-worker": {"", worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name},
}
ROLE = {"prefill-worker": "prefill", "decode-worker": "decode"}


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
    for name, svc in of_kind("Service").items():
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
    prog, ns = parse_argv(container_argv(c))
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
    _, ns = parse_argv(container_argv(main))
    cfg = service_config(dep, main, ns, tmp_path)
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
        service = probe["grpc"].get("service", "")
        if ns.command == "router" and service == CONTROL:  # served on the control port only
            assert probe["grpc"]["port"] == cfg.control.port, f"{pid} {kind}"
            continue
        assert probe["grpc"]["port"] == server.port, f"{pid} {kind}"
        assert service in HEALTH[ns.command], f"{pid} {kind}: no such health service"
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, (
        f"{pid}: startup allows too little"
    )

    # the model the initContainer writes is the one the service loads
    model = cfg.model_path if ns.command == "router" else cfg.engine.model_path
    writers = [parse_argv(container_argv(c))[1] for c in spec.get("initContainers", ())]
    assert model in {w.folder for w in writers if w.command == "make-model"}, pid

    if ns.command == "router":
        # GenerateService is NOT_SERVING until workers register: never restart the router for it
        assert probes["livenessProbe"]["grpc"]["service"] == CONTROL
        assert probes["startupProbe"]["grpc"]["service"] == CONTROL
        assert cfg.http.port in ports and not cfg.workers.prefill and not cfg.workers.decode
        assert probes["readinessProbe"]["grpc"]["service"] != CONTROL
        # RouterControl on a private listener that the pod network reaches, declared
        assert cfg.control.port in ports and cfg.control.port != server.port
        assert cfg.control.host == "0.0.0.0"
        keys = secret_keys()
        for field in ("api_keys_file", "admin_keys_file", "cluster_secret_file"):
            path = getattr(cfg.auth, field)
            assert path, f"{pid}: auth.{field} is not set"
            secret, key = secret_file(dep, main, path)
            assert secret == SECRET and key in keys, f"{pid}: auth.{field}: {secret}/{key}"
        # the one the workers mount (below)
        assert secret_file(dep, main, cfg.auth.cluster_secret_file)[1] == "cluster-secret"
        assert not sidecars
        return

    # the worker takes calls only from holders of the cluster secret (service/cluster_auth.py)
    env = {e["name"]: e.get("value") for e in main.get("env", ())}
    assert secret_file(dep, main, env["SPLITSERVE_CLUSTER_SECRET_FILE"]) == (
        SECRET,
        "cluster-secret",
    ), pid

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
    prog, reg = parse_argv(container_argv(register))
    assert prog == "splitserve.router.registration"
    assert reg.role == ROLE[ns.command] and reg.worker == f"{POD_IP}:{server.port}", pid
    assert secret_file(dep, register, reg.cluster_secret_file) == (SECRET, "cluster-secret"), pid
    host, port = reg.router.rsplit(":", 1)
    svc = of_kind("Service")[host]
    # the router is not ready before a worker registers: the sidecar must reach not-ready pods
    assert svc["spec"].get("publishNotReadyAddresses") is True, f"Service {host}"
    (target,) = [p["targetPort"] for p in svc["spec"]["ports"] if p["port"] == int(port)]
    routers = [
        (d, d["spec"]["template"]["spec"]["containers"][0])
        for _, d in PODS
        if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert routers and all(
        parse_argv(container_argv(c))[1].command == "router" for _, c in routers
    ), f"Service {host}"
    for d, c in routers:  # the sidecar's port is the router's control listener
        router_cfg = service_config(d, c, parse_argv(container_argv(c))[1], tmp_path)
        declared = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert declared[target] == router_cfg.control.port, f"Service {host}: {target}"
