"""TLS in the deploy files without a cluster or a docker engine: compose.yaml and deploy/k8s carry
every line TLS needs commented with `#TLS ` (k8s: the `grpc:` probe lines they replace end in
`#no-TLS`). The test runs the very `sed` line that the files' headers and docs/tls.md give on a
copy, then checks the result: valid YAML (and Kubernetes schema, and `kubectl kustomize` when
installed), every service's effective config (ConfigMap + flags, through the real pydantic
models and argparse parsers) names its certificate, key and CA files through real config keys,
each file is mounted read-only from the TLS Secret (or compose's ./tls folder) where the
setting points, the files play the parts they are given (a throwaway PKI under the Secret's key
names loads as each server's and client's credentials), and the probes and health checks speak
TLS to the ports the services serve, with a client certificate where mutual TLS is required."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from helpers_tls import make_pki
from k8s_helpers import (
    K8S,
    ROOT,
    container_argv,
    load_docs,
    of_kind,
    parse_argv,
    secret_file,
    secret_keys,
    service_config,
)
from test_k8s_manifests import CONTROL, HEALTH

from splitserve.service.tls import (
    TlsClientConfig,
    TlsServerConfig,
    client_credentials,
    server_credentials,
)
from splitserve.service.tls_flags import client_tls_from_args

TLS_SECRET = "splitserve-tls"
MOUNT = "/run/tls"  # where compose and the pods mount the files
COMPOSE_SERVICES = ("router", "prefill", "decode")


def _sed(text: str, target: str) -> list[str]:
    """The `sed -i ...` command line that `text` gives for `target`, as argv without the files."""
    (line,) = {m for m in re.findall(r"sed -i .*", text) if m.split()[-1].strip("`") == target}
    argv = shlex.split(line.strip("`"))
    return argv[:-1]


def _turn_on(files: list[Path], header: str, target: str, tmp_path: Path) -> tuple[Path, set]:
    """Copies of `files` in a folder of tmp_path with the header's sed run over them (which must
    be the one docs/tls.md gives); (the folder, names of the files it changed)."""
    argv = _sed(header, target)
    assert argv == _sed((ROOT / "docs" / "tls.md").read_text(), target), "docs and header differ"
    out = tmp_path / "on"
    out.mkdir()
    for f in files:
        shutil.copy(f, out / f.name)
    subprocess.run([*argv, *(str(out / f.name) for f in files)], check=True, timeout=30)
    for f in out.iterdir():
        for line in f.read_text().splitlines():
            assert not line.lstrip().startswith("#TLS "), f"{f.name}: left: {line}"
            assert not line.endswith("#no-TLS"), f"{f.name}: left: {line}"
    return out, {f.name for f in files if (out / f.name).read_text() != f.read_text()}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway PKI whose files carry the Secret's key names."""
    d = tmp_path_factory.mktemp("pki")
    made = make_pki(d)
    assert {Path(p).name for p in vars(made).values()} >= secret_keys(TLS_SECRET)
    return d


def _is_ca(path: str) -> bool:
    cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def _server(tls: TlsServerConfig, local) -> None:
    """Loads as a server's credentials (the key belongs to the certificate); a client CA is a CA."""
    files = {k: local(v) for k, v in tls if v is not None}
    server_credentials(tls.model_copy(update=files))
    assert not _is_ca(files["cert_file"]), tls
    assert "client_ca_file" not in files or _is_ca(files["client_ca_file"]), tls


def _client(tls: TlsClientConfig, local) -> None:
    """Loads as a client's credentials; what it trusts is a CA."""
    files = {k: local(v) for k, v in tls if v is not None and k != "server_name_override"}
    client_credentials(tls.model_copy(update=files))
    assert "ca_file" not in files or _is_ca(files["ca_file"]), tls


# ---- Kubernetes -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def k8s(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k8s")
    files = sorted(K8S.glob("*.yaml"))
    header = (K8S / "kustomization.yaml").read_text()
    folder, changed = _turn_on(files, header, "deploy/k8s/*.yaml", tmp)
    pods = {f for f, d in load_docs() if d["kind"] in ("Deployment", "ConfigMap")}
    assert changed == pods, f"TLS lines in {sorted(changed)}, not in all of {sorted(pods)}"
    return folder, load_docs(folder)


def test_k8s_tls_manifests_are_valid(k8s):
    folder, docs = k8s
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
        except kubernetes_validate.ValidationError as err:
            raise AssertionError(f"{name}: {'.'.join(map(str, err.path))}: {err.message}") from None
    if shutil.which("kubectl"):
        out = subprocess.run(
            ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr


def test_k8s_tls_settings_name_mounted_files_of_the_secret(k8s, pki, tmp_path):
    _, docs = k8s
    keys = secret_keys(TLS_SECRET)

    def local_for(dep, c):
        def local(path: str) -> str:
            secret, key = secret_file(dep, c, path)
            assert secret == TLS_SECRET and key in keys, (c["name"], path, secret, key)
            return str(pki / key)

        return local

    pods = [d for _, d in docs if d["kind"] == "Deployment"]
    routers = []
    sidecars = []
    for dep in pods:
        main, *rest = dep["spec"]["template"]["spec"]["containers"]
        _, ns = parse_argv(container_argv(main))
        cfg = service_config(dep, main, ns, tmp_path, docs)
        pid = dep["metadata"]["name"]
        assert cfg.server.tls is not None, f"{pid}: server.tls is not set"
        local = local_for(dep, main)
        _server(cfg.server.tls, local)
        worker = ns.command != "router"
        # workers take only the router's certificate; the router's public port takes any client
        assert (cfg.server.tls.client_ca_file is not None) == worker, pid
        if not worker:
            routers.append(cfg)
            assert cfg.workers_tls is not None and cfg.workers_tls.cert_file, "no mutual TLS"
            _client(cfg.workers_tls, local)
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = main[kind]
            assert "grpc" not in probe and probe.get("timeoutSeconds", 1) >= 5, (pid, kind)
            prog, health = parse_argv(probe["exec"]["command"])
            assert prog == "splitserve" and health.command == "health", (pid, kind)
            host, port = health.address.rsplit(":", 1)
            assert host == "127.0.0.1", (pid, kind)
            ports = {cfg.server.port} | ({cfg.control.port} if not worker else set())
            assert int(port) in ports, (pid, kind, port)
            if not worker and health.service == CONTROL:
                assert int(port) == cfg.control.port, (pid, kind)
            else:
                assert health.service in HEALTH[ns.command], (pid, kind, health.service)
            tls = client_tls_from_args(health)
            assert tls is not None and tls.ca_file is not None, (pid, kind)
            assert (tls.cert_file is not None) == worker, (pid, kind, "mutual TLS")
            _client(tls, local)
        sidecars += [(dep, c) for c in rest]
    assert len(routers) == 1 and sidecars
    (router,) = routers
    for dep, c in sidecars:
        _, reg = parse_argv(container_argv(c))
        tls = client_tls_from_args(reg)
        assert tls is not None and tls.cert_file is not None, c["name"]  # its worker's mutual TLS
        _client(tls, local_for(dep, c))
        # the one name the router checks on workers, which the sidecar checks on both
        assert tls.server_name_override == router.workers_tls.server_name_override
    # every TLS volume is the Secret, read-only to every container that mounts it
    for dep in pods:
        spec = dep["spec"]["template"]["spec"]
        tls_volumes = [
            v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == TLS_SECRET
        ]
        assert len(tls_volumes) == 1, dep["metadata"]["name"]
        for c in spec["containers"]:
            for m in c.get("volumeMounts", ()):
                if m["name"] == tls_volumes[0]["name"]:
                    assert m["mountPath"] == MOUNT and m.get("readOnly") is True, c["name"]
    assert of_kind("ConfigMap", docs)


# ---- compose ---------------------------------------------------------------------------------------
def _expand(arg: str) -> str:
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)


def _compose_config(ns):
    from splitserve.cli import decode_worker_cmd, prefill_worker_cmd, router_cmd
    from splitserve.cli.worker_args import config_overrides
    from splitserve.decode_worker.config import load as load_decode
    from splitserve.prefill_worker.config import PrefillWorkerConfig
    from splitserve.router.config import RouterConfig

    if ns.command == "router":
        overrides = {field: getattr(ns, dest) for dest, field in router_cmd._OVERRIDES.items()}
        return RouterConfig.load(None, overrides)
    module, load = {
        "prefill-worker": (prefill_worker_cmd, PrefillWorkerConfig.load),
        "decode-worker": (decode_worker_cmd, load_decode),
    }[ns.command]
    path = ROOT / "deploy" / Path(ns.config).name if ns.config else None
    return load(path, config_overrides(ns, module._OVERRIDES))


def test_compose_tls_lines_name_files_of_the_tls_folder(pki, tmp_path):
    plain = yaml.safe_load((ROOT / "compose.yaml").read_text())
    compose = ROOT / "compose.yaml"
    folder, changed = _turn_on([compose], compose.read_text(), "compose.yaml", tmp_path)
    assert changed == {"compose.yaml"}
    on = yaml.safe_load((folder / "compose.yaml").read_text())
    names = secret_keys(TLS_SECRET)  # the same five files

    def local(path: str) -> str:
        assert path.startswith(MOUNT + "/"), path
        name = path.removeprefix(MOUNT + "/")
        assert name in names, path
        return str(pki / name)

    for name in COMPOSE_SERVICES:
        svc, before = on["services"][name], plain["services"][name]
        assert f"./tls:{MOUNT}:ro" in svc["volumes"], name
        assert f"./tls:{MOUNT}:ro" not in before["volumes"], name
        _, ns = parse_argv(["splitserve", *map(_expand, svc["command"])])
        _, plain_ns = parse_argv(["splitserve", *map(_expand, before["command"])])
        assert _compose_config(plain_ns).server.tls is None, f"{name}: TLS on before the sed"
        cfg = _compose_config(ns)
        assert cfg.server.tls is not None, name
        _server(cfg.server.tls, local)
        worker = ns.command != "router"
        assert (cfg.server.tls.client_ca_file is not None) == worker, name
        if not worker:
            assert cfg.workers_tls is not None and cfg.workers_tls.cert_file, name
            _client(cfg.workers_tls, local)
        test = svc["healthcheck"]["test"]
        assert test[:2] == ["CMD", "splitserve"], name
        _, health = parse_argv(test[1:])
        assert health.address == f"127.0.0.1:{cfg.server.port}", name
        tls = client_tls_from_args(health)
        assert tls is not None and (tls.cert_file is not None) == worker, name
        _client(tls, local)
