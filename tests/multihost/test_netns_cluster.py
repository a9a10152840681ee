"""Router, prefill and decode worker on three "hosts" (network namespaces joined by a bridge,
see netns.py), started with the real CLI, registered by the real sidecar, KV over UCX/TCP
between hosts; requests come from inside the router's host. Then cables get pulled:

* the decode host's link goes down mid-stream: the client gets UNAVAILABLE after the tokens
  already sent, the router evicts the worker; with the link back, requests succeed again;
* the prefill host's link goes down during a KV transfer: the decode side's transfer timeout
  and failure policy (recompute) apply, same tokens; with the link back, no KV is held.

Eviction and recovery times are printed and recorded (record_property). Skipped where network
namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import netns
import pytest
import yaml
from helpers_procs import cli_command

from splitserve.config.engine_config import EngineConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.offline import OfflineEngine
from splitserve.request.sampling_params import SamplingParams

WHY_NOT = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")

PORTS = {"router": 50051, "prefill": 50061, "decode": 50071}  # every host has its own port space
KV_PORT, PREFILL_METRICS, DECODE_METRICS = 50062, 9461, 9471
BLOCK, MAX_LEN = 16, 1024
KEEPALIVE = {
    "keepalive_time_s": 1.0,
    "keepalive_timeout_s": 1.0,
    "drain_grace_s": 1.0,
}  # a dead peer in ~2 s
PROMPT = [1, 44, 45, 46, 200, 201, 202]


def _configs(model: str, ip: dict[str, str]) -> dict[str, dict]:
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

    def start(self, name: str, host: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - the child holds it
        # UCX_PROTO_INFO: UCX logs the transport/device of each protocol it selects (asserted below)
        env = {
            **os.environ,
            "UCX_WARN_UNUSED_ENV_VARS": "n",
            "PYTHONUNBUFFERED": "1",
            "UCX_PROTO_INFO": "y",
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
        """The router's view of its workers; {} while the router does not answer (starting)."""
        got = self.driver.call("info", router=self.addr["router"], check=False)
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

    def stream(self, request_id: str, max_tokens: int, ids=PROMPT):
        return self.driver.send(
            "generate",
            router=self.addr["router"],
            ids=ids,
            max_tokens=max_tokens,
            request_id=request_id,
        )

    def generate(self, request_id: str, max_tokens: int, ids=PROMPT, timeout: float = 30.0):
        return finish(self.stream(request_id, max_tokens, ids), [], timeout)[:3]

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
            loads = {
                h: self.driver.call("load", address=self.addr[h], role=h).get("load")
                for h in ("prefill", "decode")
            }
            if all(
                ld
                and ld["free_blocks"] == ld["total_blocks"] > 0
                and not (ld["num_running"] or ld["num_waiting"] or ld["leases_held"])
                for ld in loads.values()
            ):
                return
            time.sleep(0.2)
        raise AssertionError(f"KV still held after {timeout}s: {loads}")


def finish(replies, tokens: list[int], timeout: float) -> tuple[list[int], str, str, float]:
    """Reads a stream to its end: (all tokens, status code name, details, when the end arrived)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = replies.get(timeout=max(0.1, deadline - time.monotonic()))
        if msg.get("event") == "tokens":
            tokens.extend(msg["ids"])
        else:
            return (
                tokens,
                msg.get("code", "ERROR"),
                msg.get("details", msg.get("error", "")),
                msg["at"],
            )


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("netns_cluster")
    topo = netns.Topology()
    c = Cluster(topo, log_dir)
    try:
        topo.create()
        for name, cfg in _configs(str(tiny_llama), topo.ip).items():
            (log_dir / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
            c.start(
                name,
                name,
                [
                    *cli_command(f"{name}-worker" if name != "router" else "router"),
                    "--config",
                    str(log_dir / f"{name}.yaml"),
                ],
            )
        for role in ("prefill", "decode"):  # each worker's sidecar registers its advertised address
            c.start(
                f"{role}-sidecar",
                role,
                [
                    sys.executable,
                    "-m",
                    "splitserve.router.registration",
                    "--router",
                    c.addr["router"],
                    "--role",
                    role,
                    "--worker",
                    c.addr[role],
                ],
            )
        driver = Path(netns.__file__).with_name("netns_driver.py")
        c.driver = netns.Driver(
            topo.command("router", [sys.executable, str(driver)]), log_dir / "driver.log"
        )
        c.wait_health("prefill", True, 120)
        c.wait_health("decode", True, 30)
        yield c
        codes = c.stop()  # after the faults, every service still drains and exits cleanly
        assert [codes[n] for n in PORTS] == [0, 0, 0], f"{codes}\n{c.logs()}"
    finally:
        c.stop()
        topo.destroy()


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    engine = OfflineEngine(
        ModelRunner(
            EngineConfig(
                model_path=str(tiny_llama),
                device="cpu",
                cache={"num_blocks": 80, "block_size": BLOCK},
                scheduler={"max_model_len": MAX_LEN},
            )
        )
    )
    return lambda n, ids=PROMPT: (
        engine.generate([ids], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)])[
            0
        ].token_ids
    )


def test_services_bind_advertise_and_serve_across_hosts(cluster, oracle):
    ip = cluster.topo.ip
    # the registry holds the addresses the sidecars registered; the KV handle names the
    # prefill host's routable IP although that worker binds 0.0.0.0 and advertises nothing
    assert cluster.health() == {cluster.addr["prefill"]: True, cluster.addr["decode"]: True}
    load = cluster.driver.call("load", address=cluster.addr["prefill"], role="prefill")["load"]
    assert load["kv_address"] == {"host": ip["prefill"], "port": KV_PORT, "worker_address": ""}
    failed, received = cluster.pulls()
    results = [
        cluster.generate(f"ok-{i}", 12, ids) for i, ids in enumerate((PROMPT, [1, 7, 8, 9, 10]))
    ]
    for ids, (tokens, code, details) in zip((PROMPT, [1, 7, 8, 9, 10]), results):
        assert code == "OK", details
        assert tokens == oracle(12, ids)
    after_failed, after_received = cluster.pulls()
    assert (
        after_failed == failed and after_received > received
    )  # the KV crossed hosts over UCX, no recompute
    for worker in (
        "prefill",
        "decode",
    ):  # ... over TCP on the host's link (never shared memory or loopback)
        lanes = set(
            re.findall(
                r"\|\s+(\w+/[\w.]+)\s+\|\s*$", (cluster.log_dir / f"{worker}.log").read_text(), re.M
            )
        )
        assert lanes == {"tcp/eth0"}, (worker, lanes)
    # the classic mistake: a worker registering an address only its own host can dial
    wrong = cluster.start(
        "misadvertised-sidecar",
        "prefill",
        [
            sys.executable,
            "-m",
            "splitserve.router.registration",
            "--router",
            cluster.addr["router"],
            "--role",
            "prefill",
            "--worker",
            f"127.0.0.1:{PORTS['prefill']}",
        ],
    )
    assert wrong.wait(30) == 2
    said = (cluster.log_dir / "misadvertised-sidecar.log").read_text()
    assert "cannot reach prefill worker 127.0.0.1:" in said and "--advertise-host" in said
    cluster.assert_free()


def test_decode_link_down_mid_stream(cluster, oracle, record_property):
    # ~1000 tokens at about a millisecond each on CPU: the cable goes once the decode worker has
    # streamed its first token (the first came from the prefill worker), well before the end
    replies, tokens = cluster.stream("a-mid-stream", MAX_LEN - len(PROMPT) - 8), []
    while len(tokens) < 2:
        msg = replies.get(timeout=30)
        assert msg.get("event") == "tokens", msg
        tokens.extend(msg["ids"])
    t_down = time.monotonic()
    cluster.topo.link("decode", up=False)
    evicted_s = cluster.wait_health("decode", False, 15)
    tokens, code, details, ended = finish(replies, tokens, 30)
    unavailable_s = ended - t_down
    assert code == "UNAVAILABLE", details
    assert f"failed after {len(tokens)} tokens were streamed" in details
    assert tokens == oracle(len(tokens))  # what arrived is right; nothing replayed
    down = cluster.generate("a-while-down", 4)
    assert down[1] == "UNAVAILABLE" and "no healthy decode worker" in down[2]

    recovered_s, served_s = _link_back_up(cluster, oracle, "decode")
    cluster.assert_free()
    times = {
        "decode_evicted_s": evicted_s,
        "client_unavailable_s": unavailable_s,
        "decode_recovered_s": recovered_s,
        "decode_first_success_s": served_s,
    }
    _report(record_property, f"decode link down mid-stream ({len(tokens)} tokens streamed)", times)
    # the broken stream/transport (keepalive 1 s + 1 s) and heartbeat silence (2 s) evict at once
    # (measured 1.3 s); slow probes alone would need three timeouts; slack for a busy 2-core machine
    assert evicted_s < 3.0
    assert unavailable_s < 5.0  # the stream's keepalive (1 s + 1 s) and the router's answer
    assert (
        recovered_s < 10.0 and served_s < 12.0
    )  # reconnect backoff (5 s) + probe, then one request


def test_prefill_link_down_during_transfer(cluster, oracle, record_property):
    failed, received = cluster.pulls()
    replies, tokens = cluster.stream("cut-transfer", 12), []
    msg = replies.get(timeout=30)  # the first token: prefill done, the pull is under way
    assert msg.get("event") == "tokens", msg
    deadline = time.monotonic() + 10
    while cluster.sending() < 1:  # the event itself: the lease answered, the payload not yet sent
        assert time.monotonic() < deadline, "the pull never reached the stall before its payload"
        time.sleep(0.02)
    t_down = time.monotonic()
    cluster.topo.link("prefill", up=False)
    evicted_s = cluster.wait_health("prefill", False, 15)
    tokens, code, details, ended = finish(replies, list(msg["ids"]), 30)
    done_s = ended - t_down
    assert code == "OK", (
        details
    )  # failure_policy recompute: the decode worker recomputed the prompt
    assert tokens == oracle(12)
    now_failed, _ = cluster.pulls()
    new = {k: v - failed.get(k, 0) for k, v in now_failed.items() if v != failed.get(k, 0)}
    assert sum(new.values()) == 1, (
        new
    )  # one pull timed out (data_timeout, or an earlier phase's timeout)
    assert set(new) <= {"data_timeout", "lease_timeout", "peer_failed"}, new

    recovered_s, served_s = _link_back_up(cluster, oracle, "prefill")
    assert cluster.pulls()[0] == now_failed  # the KV moved again: no further failed pull
    cluster.assert_free(
        timeout=20
    )  # the stalled lease went back (released or expired) on the prefill host
    times = {
        "prefill_evicted_s": evicted_s,
        "recomputed_request_done_s": done_s,
        "prefill_recovered_s": recovered_s,
        "prefill_first_success_s": served_s,
    }
    _report(record_property, f"prefill link down during transfer (failed pull: {new})", times)
    assert evicted_s < 3.0 and done_s < 8.0  # transfer timeouts of 1-3.5 s, then the recompute
    assert (
        recovered_s < 10.0 and served_s < 12.0
    )  # reconnect backoff (5 s) + probe, then one request


def _link_back_up(cluster, oracle, host: str) -> tuple[float, float]:
    """Bring `host`'s link up; seconds until the router sees it healthy and until a request
    through it is served right again."""
    t_up = time.monotonic()
    cluster.topo.link(host, up=True)
    recovered_s = cluster.wait_health(host, True, 30)
    back = cluster.generate(f"{host}-after", 12)
    served_s = time.monotonic() - t_up
    assert back[1] == "OK" and back[0] == oracle(12), back
    return recovered_s, served_s


def _report(record_property, what: str, times: dict[str, float]) -> None:
    for k, v in times.items():
        record_property(k, round(v, 3))
    print(f"\n{what}: " + ", ".join(f"{k}={v:.2f}" for k, v in times.items()))
