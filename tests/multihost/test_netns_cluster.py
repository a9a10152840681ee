"""Router, prefill and decode worker on three "hosts" (network namespaces joined by a bridge,
see netns.py), started with the real CLI, registered by the real sidecar, KV over UCX/TCP
between hosts; requests come from inside the router's host. The router binds beyond loopback,
so it runs as a deployment would (docs/security.md): API and admin keys written by `keygen`, a
cluster secret that the sidecars present to register and that the workers require of the
router; a caller without a key, a plain key asking for worker addresses and a sidecar without
the secret are refused across hosts. Then cables get pulled:

* the decode host's link goes down mid-stream: the client gets UNAVAILABLE after the tokens
  already sent, the router evicts the worker; with the link back, requests succeed again;
* the prefill host's link goes down during a KV transfer: the decode side's transfer timeout
  and failure policy (recompute) apply, same tokens; with the link back, no KV is held.

Eviction and recovery times are printed and recorded (record_property). Skipped where network
namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import netns
import pytest
import yaml
from helpers_procs import cli_command
from netns_cluster import BLOCK, KV_PORT, MAX_LEN, PORTS, PROMPT, Cluster, finish, service_configs

from splitserve.config.engine_config import EngineConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.offline import OfflineEngine
from splitserve.request.sampling_params import SamplingParams

WHY_NOT = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("netns_cluster")
    topo = netns.Topology()
    c = Cluster(topo, log_dir)
    try:
        topo.create()
        # workers with the cluster secret take calls only from its holders (the router)
        worker_env = {"SPLITSERVE_CLUSTER_SECRET_FILE": str(c.secrets["cluster-secret"])}
        for name, cfg in service_configs(str(tiny_llama), topo.ip, c.secrets).items():
            (log_dir / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
            c.start(
                name,
                name,
                [
                    *cli_command(f"{name}-worker" if name != "router" else "router"),
                    "--config",
                    str(log_dir / f"{name}.yaml"),
                ],
                env=worker_env if name != "router" else None,
            )
        for role in ("prefill", "decode"):  # each worker's sidecar registers its advertised address
            c.sidecar(f"{role}-sidecar", role, c.addr[role])
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
    load = cluster.load("prefill")["load"]
    assert load["kv_address"] == {"host": ip["prefill"], "port": KV_PORT, "worker_address": ""}
    failed, received = cluster.pulls()
    results = [
        cluster.generate_handover(f"ok-{i}", 12, ids)
        for i, ids in enumerate((PROMPT, [1, 7, 8, 9, 10]))
    ]
    for ids, (tokens, code, details, streamed) in zip((PROMPT, [1, 7, 8, 9, 10]), results):
        assert code == "OK", details
        assert tokens == oracle(12, ids)
        assert streamed is True  # the default streamed hand-over, across hosts (no fallback)
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
    wrong = cluster.sidecar("misadvertised-sidecar", "prefill", f"127.0.0.1:{PORTS['prefill']}")
    assert wrong.wait(30) == 2
    said = (cluster.log_dir / "misadvertised-sidecar.log").read_text()
    assert "cannot reach prefill worker 127.0.0.1:" in said and "--advertise-host" in said
    cluster.assert_free()


def test_keys_and_the_cluster_secret_across_hosts(cluster):
    # a sidecar without the secret cannot register, not even a real worker's address
    rogue = cluster.sidecar("rogue-sidecar", "decode", cluster.addr["decode"], secret=False)
    assert rogue.wait(30) == 2
    said = (cluster.log_dir / "rogue-sidecar.log").read_text()
    assert "registration: error:" in said and "secret" in said, said
    # no key, or a plain key asking for worker addresses; a worker called without the secret
    no_key = cluster.generate("no-key", 4, with_key=False)
    plain = cluster.driver.call("info", router=cluster.addr["router"], key=cluster.key)
    assert no_key[1] == "UNAUTHENTICATED" and "API key is required" in no_key[2], no_key
    assert sorted(plain["workers"]) == [[1, "", True], [2, "", True]]
    assert cluster.load("decode", secret=False).get("error") == "UNAUTHENTICATED"
    # the cluster is unchanged: the same two workers, serving
    assert cluster.health() == {cluster.addr["prefill"]: True, cluster.addr["decode"]: True}
    assert cluster.generate("with-key", 4)[1] == "OK"
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
    # the streamed hand-over (the default) timed out or saw its peer go (data_timeout, or an
    # earlier phase's timeout); its fallback, the pull after the prefill, cannot reach the
    # prefill host either (connect, or one of the same) before the decode worker recomputes
    assert 1 <= sum(new.values()) <= 2, new
    assert set(new) <= {"data_timeout", "lease_timeout", "peer_failed", "connect"}, new

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
    # no stream is open to a prefill worker: heartbeat silence (2 s) evicts it, or three 1 s
    # probes (~3.6 s); measured 3.43 s on a loaded 2-core CI machine, so a bound here cannot
    # tell the two apart (the eviction reason would: the router's worker_evictions metric)
    assert evicted_s < 6.0 and done_s < 10.0  # transfer timeouts of 1-3.5 s, then the recompute
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
