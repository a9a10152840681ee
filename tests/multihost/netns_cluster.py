"""The three-host cluster of test_netns_cluster.py: each service's config, its secrets (keys
written as `splitserve keygen` writes them), and `Cluster`, which starts the real processes in
their namespaces and talks to them through the driver inside the router's host (netns.py,
netns_driver.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import netns

from splitserve.cli.keygen_cmd import write_new_key

PORTS = {"router": 50051, "prefill": 50061, "decode": 50071}  # every host has its own port space
KV_PORT, PREFILL_METRICS, DECODE_METRICS = 50062, 9461, 9471
BLOCK, MAX_LEN = 16, 1024
KEEPALIVE = {
    "keepalive_time_s": 1.0,
    "keepalive_timeout_s": 1.0,
    "drain_grace_s": 1.0,
}  # a dead peer in ~2 s
PROMPT = [1, 44, 45, 46, 200, 201, 202]


def write_secrets(folder: Path) -> dict[str, Path]:
    """API key, admin key and cluster secret files, as `splitserve keygen` writes them."""
    files = {name: folder / name for name in ("api-keys", "admin-keys", "cluster-secret")}
    for path in files.values():
        assert write_new_key(path)
    return files


def service_configs(model: str, ip: dict[str, str], secrets: dict[str, Path]) -> dict[str, dict]:
    engine = {
        "model_path": model,
        "device": "cpu",
        "cache": {"block_size": BLOCK, "num_blocks": 160},
        "scheduler": {"max_model_len": MAX_LEN},
    }
    return {
        # bound to every interface, advertised explicitly
        "router": {
            "model_path": model,
            "max_model_len": MAX_LEN,
            "worker_call_timeout_s": 2.0,
            "server": {
                "host": "0.0.0.0",
                "port": PORTS["router"],
                "advertise_host": ip["router"],
                **KEEPALIVE,
            },
            "registry": {
                "poll_interval_s": 0.2,
                "probe_timeout_s": 1.0,
                "heartbeat_interval_s": 0.3,
                "heartbeat_timeout_s": 2.0,
            },
            # RouterControl stays on the public port: registration needs the cluster secret
            "auth": {
                "api_keys_file": str(secrets["api-keys"]),
                "admin_keys_file": str(secrets["admin-keys"]),
                "cluster_secret_file": str(secrets["cluster-secret"]),
            },
        },
        # bound to every interface, nothing advertised: the host's routable IP (no default route here)
        "prefill": {
            "engine": engine,
            "lease_ttl_s": 4.0,
            "server": {
                "host": "0.0.0.0",
                "port": PORTS["prefill"],
                "metrics_port": PREFILL_METRICS,
                **KEEPALIVE,
            },
            "kv_transfer": {"listen_port": KV_PORT, "data_timeout_s": 1.5},
            # the cable is pulled while "cut-" pulls stall between the lease reply and the payload;
            # the stall alone stays inside decode's data timeout: only the cut link fails the pull
            "faults": {"transfer": {"stall_before_payload_s": 2.0, "request_id_prefix": "cut-"}},
        },
        # bound to its own IP, which it then advertises
        "decode": {
            "engine": engine,
            "server": {
                "host": ip["decode"],
                "port": PORTS["decode"],
                "metrics_port": DECODE_METRICS,
                **KEEPALIVE,
            },
            "kv_transfer": {
                "connect_timeout_s": 1.0,
                "lease_request_timeout_s": 1.0,
                "data_timeout_s": 3.5,
                "failure_policy": "recompute",
            },
        },
    }


class Cluster:
    def __init__(self, topo: netns.Topology, log_dir) -> None:
        self.topo, self.log_dir = topo, log_dir
        self.addr = {h: f"{topo.ip[h]}:{p}" for h, p in PORTS.items()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.driver: netns.Driver | None = None
        self.secrets = write_secrets(log_dir / "secrets")
        self.key, self.admin_key, self.cluster_secret = (
            self.secrets[n].read_text().strip()
            for n in ("api-keys", "admin-keys", "cluster-secret")
        )

    def sidecar(self, name: str, role: str, worker: str, secret: bool = True) -> subprocess.Popen:
        """The real registration sidecar on `role`'s host, registering `worker`."""
        argv = [sys.executable, "-m", "splitserve.router.registration"]
        argv += ["--router", self.addr["router"], "--role", role, "--worker", worker]
        if secret:
            argv += ["--cluster-secret-file", str(self.secrets["cluster-secret"])]
        return self.start(name, role, argv)

    def start(
        self, name: str, host: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - the child holds it
        # UCX_PROTO_INFO: UCX logs the transport/device of each protocol it selects (asserted below)
        env = {
            **os.environ,
            "UCX_WARN_UNUSED_ENV_VARS": "n",
            "PYTHONUNBUFFERED": "1",
            "UCX_PROTO_INFO": "y",
            **(env or {}),
        }
        proc = subprocess.Popen(
            self.topo.command(host, argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
            process_group=0,
        )
        self.procs[name] = proc
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def stop(self) -> dict[str, int]:
        """SIGTERM every process, SIGKILL (its group) after 5 s; name -> exit code."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.driver is not None:
            self.driver.close()
        return {name: proc.returncode for name, proc in self.procs.items()}

    # ---- through the driver, from inside the router's host ------------------------------------
    def health(self) -> dict[str, bool]:
        """The router's view of its workers (addresses: the admin key); {} while the router does
        not answer (starting)."""
        got = self.driver.call("info", router=self.addr["router"], key=self.admin_key, check=False)
        return {a: ok for _, a, ok in got.get("workers", [])}

    def wait_health(self, host: str, healthy: bool, timeout: float) -> float:
        """Seconds until the router's registry shows `host`'s worker healthy (or not)."""
        t0 = time.monotonic()
        while self.health().get(self.addr[host]) is not healthy:
            assert time.monotonic() - t0 < timeout, (
                f"{host} not healthy={healthy} within {timeout}s\n{self.logs()}"
            )
            time.sleep(0.05)
        return time.monotonic() - t0

    def stream(self, request_id: str, max_tokens: int, ids=PROMPT, with_key: bool = True):
        """A Generate stream, with the cluster's API key (or none)."""
        return self.driver.send(
            "generate",
            router=self.addr["router"],
            ids=ids,
            max_tokens=max_tokens,
            request_id=request_id,
            key=self.key if with_key else None,
        )

    def generate(
        self, request_id: str, max_tokens: int, ids=PROMPT, timeout: float = 30.0, with_key=True
    ):
        return finish(self.stream(request_id, max_tokens, ids, with_key), [], timeout)[:3]

    def generate_handover(self, request_id: str, max_tokens: int, ids=PROMPT, timeout=30.0):
        """(tokens, code, details, streamed): streamed is the final chunk's
        kv_handover.streamed (True: the KV came layer by layer during the prefill)."""
        end: dict = {}
        tokens, code, details, _ = finish(
            self.stream(request_id, max_tokens, ids), [], timeout, end
        )
        return tokens, code, details, end.get("streamed")

    def load(self, host: str, secret: bool = True) -> dict:
        """GetLoad of `host`'s worker, which takes it only with the cluster secret."""
        key = self.cluster_secret if secret else None
        return self.driver.call("load", address=self.addr[host], role=host, key=key)

    def sending(self) -> float:
        """Prefill side: pulls answered and not yet done (the stall before the payload included)."""
        text = self.driver.call(
            "metrics", url=f"http://{self.topo.ip['prefill']}:{PREFILL_METRICS}/metrics"
        )["text"]
        got = re.search(r"^splitserve_kv_transfer_sending (\S+)$", text, re.M)
        return float(got.group(1)) if got else 0.0

    def pulls(self) -> tuple[dict[str, float], float]:
        """Decode side: failed pulls by reason, KV bytes received."""
        text = self.driver.call(
            "metrics", url=f"http://{self.topo.ip['decode']}:{DECODE_METRICS}/metrics"
        )["text"]
        failed = {
            m[0]: float(m[1])
            for m in re.findall(
                r'^splitserve_kv_transfer_failures_total\{reason="(\w+)"\} (\S+)$', text, re.M
            )
        }
        got = re.search(
            r'^splitserve_kv_transfer_bytes_total\{direction="received"\} (\S+)$', text, re.M
        )
        return failed, float(got.group(1)) if got else 0.0

    def assert_free(self, timeout: float = 15.0) -> None:
        """No request, no lease, every KV block free on both workers."""
        t0, loads = time.monotonic(), {}
        while time.monotonic() - t0 < timeout:
            loads = {h: self.load(h).get("load") for h in ("prefill", "decode")}
            if all(
                ld
                and ld["free_blocks"] == ld["total_blocks"] > 0
                and not (ld["num_running"] or ld["num_waiting"] or ld["leases_held"])
                for ld in loads.values()
            ):
                return
            time.sleep(0.2)
        raise AssertionError(f"KV still held after {timeout}s: {loads}")


def finish(
    replies, tokens: list[int], timeout: float, end: dict | None = None
) -> tuple[list[int], str, str, float]:
    """Reads a stream to its end: (all tokens, status code name, details, when the end arrived);
    `end`, if given, gets the driver's end message (e.g. its "streamed")."""
    deadline = time.monotonic() + timeout
    while True:
        msg = replies.get(timeout=max(0.1, deadline - time.monotonic()))
        if msg.get("event") == "tokens":
            tokens.extend(msg["ids"])
        else:
            if end is not None:
                end.update(msg)
            return (
                tokens,
                msg.get("code", "ERROR"),
                msg.get("details", msg.get("error", "")),
                msg["at"],
            )
