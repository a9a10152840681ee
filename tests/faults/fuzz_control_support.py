"""The control-listener fuzzers' shared parts (test_fuzz_control.py, test_fuzz_metrics_ports.py):
the fixture `ctl`, a router process with a private control listener (`--control-port`) and a
cluster secret in front of the fault suite's workers (one per module), and `ended_ctl`, the checks
after every test: every service SERVING (the control listener's RouterControl too), every KV
block free, the oracle's tokens through the router, no traceback in any log. Registered in
conftest.py."""

from __future__ import annotations

import re
import secrets

import pytest
from fuzz_support import Front, _end, _worker_procs
from helpers_procs import ProcessGroup, free_port, health_status
from router_helpers import MAX_MODEL_LEN, SERVING

CONTROL = "splitserve.v1.RouterControl"


def control_address(log: str) -> str:
    """The control listener's address, from the router's start-up line (--control-port 0)."""
    found = re.search(r"worker registration on (\S+?),", log)
    assert found, log
    return found[1]


@pytest.fixture(scope="module")
def ctl(cluster, tmp_path_factory):
    """A router with a control listener, its Front (public side) and the control address."""
    work = tmp_path_factory.mktemp("fuzz_control")
    secret = secrets.token_urlsafe(24)
    (work / "cluster-secret").write_text(secret)
    with ProcessGroup(work) as procs:
        http_port, metrics = free_port(), free_port()
        proc = procs.router(
            cluster.model,
            *("--prefill", cluster.prefill, "--decode", cluster.decode, "--model-name", "tiny"),
            *("--http-port", str(http_port), "--metrics-port", str(metrics)),
            *("--max-model-len", str(MAX_MODEL_LEN), "--cluster-secret-file", str(work / "cluster-secret")),
            *("--control-host", "127.0.0.1", "--control-port", "0"),
        )  # fmt: skip
        control = control_address(proc.log())
        assert health_status(control, CONTROL) == SERVING, proc.log()
        yield Front(proc, http_port, metrics, secret), control
        assert proc.stop() == 0, proc.log()[-20000:]
        assert "Traceback" not in proc.log(), proc.log()[-20000:]


@pytest.fixture
def ended_ctl(ctl, cluster, oracle):
    """The end of every test (module docstring), the logs read from the test's start on."""
    front, control = ctl
    procs = [front.proc, *_worker_procs(cluster)]
    marks = [(p, len(p.log_path.read_bytes())) for p in procs]
    yield
    assert health_status(control, CONTROL) == SERVING
    _end(front, cluster, oracle)
    for p, mark in marks:
        tail = p.log_path.read_bytes()[mark:].decode(errors="replace")
        assert "Traceback" not in tail, f"{p.name} logged a traceback:\n{tail[-20000:]}"
