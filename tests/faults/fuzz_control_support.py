"""The control-listener fuzzers' shared parts (test_fuzz_control.py, test_fuzz_metrics_ports.py):
the fixture `ctl`, a router process with a private control listener (`--control-port`) and a
cluster secret in front of the fault suite's workers (one per module), and `ended_ctl`, the checks
after every test: every service SERVING (the control listener's RouterControl too), every KV
block free, the oracle's tokens through the router, no traceback in any log. Registered in
conftest.py."""

from __future__ import annotations

import re

import pytest
from fuzz_router import no_new_tracebacks, start_secret_router
from fuzz_support import _end, _worker_procs
from helpers_procs import ProcessGroup, health_status
from router_helpers import SERVING

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
    with ProcessGroup(work) as procs:
        front = start_secret_router(
            procs, cluster, work, "--control-host", "127.0.0.1", "--control-port", "0"
        )
        control = control_address(front.proc.log())
        assert health_status(control, CONTROL) == SERVING, front.proc.log()
        yield front, control
        assert front.proc.stop() == 0, front.proc.log()[-20000:]
        assert "Traceback" not in front.proc.log(), front.proc.log()[-20000:]


@pytest.fixture
def ended_ctl(ctl, cluster, oracle):
    """The end of every test (module docstring), the logs read from the test's start on."""
    front, control = ctl
    with no_new_tracebacks([front.proc, *_worker_procs(cluster)]):
        yield
        assert health_status(control, CONTROL) == SERVING
        _end(front, cluster, oracle)
