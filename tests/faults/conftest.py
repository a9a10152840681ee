"""Fixtures of the fault suite: one prefill and one decode worker process shared by every case
that leaves them alive (cases that kill or stop a worker start their own), the oracle, and a
per-test ProcessGroup. The shared workers carry test-only `faults` (see their configs) that hit
only request ids with a chosen prefix, so ordinary requests are unaffected."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "router"))  # router_helpers, reused

from fault_helpers import (  # noqa: E402
    CHUNK,
    LAST_CHUNK_S,
    PULL_DELAY_S,
    REPLY_DELAY_S,
    SLOW_PREFILL,
    SLOW_PULL,
    FaultCluster,
    start_worker,
)
from helpers_procs import ProcessGroup  # noqa: E402
from router_helpers import make_oracle  # noqa: E402


@pytest.fixture(scope="package")
def cluster(tiny_llama, tmp_path_factory):
    with ProcessGroup(tmp_path_factory.mktemp("faults_cluster")) as procs:
        prefill, pm = start_worker(
            procs,
            "prefill",
            tiny_llama,
            {
                "last_chunk_delay_s": LAST_CHUNK_S,
                "reply_delay_s": REPLY_DELAY_S,
                "request_id_prefix": SLOW_PREFILL,
            },
            "--max-num-batched-tokens",
            str(CHUNK),
            wait=False,
        )
        decode, dm = start_worker(
            procs,
            "decode",
            tiny_llama,
            {"delay_before_pull_s": PULL_DELAY_S, "request_id_prefix": SLOW_PULL},
            wait=False,
        )
        prefill.wait_serving()
        decode.wait_serving()
        yield FaultCluster(tiny_llama, procs, prefill.address, decode.address, pm, dm)
        assert prefill.stop() == 0, prefill.log()
        assert decode.stop() == 0, decode.log()


@pytest.fixture(scope="package")
def oracle(tiny_llama):
    return make_oracle(tiny_llama)


@pytest.fixture
def procs(tmp_path):
    with ProcessGroup(tmp_path) as group:
        yield group


# ---- the fuzz suite's router (test_fuzz_*.py): one for the package, like the workers ------------
from fuzz_router import no_new_tracebacks, start_secret_router  # noqa: E402
from fuzz_support import _worker_procs  # noqa: E402


@pytest.fixture(scope="package")
def front(cluster, tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz_front")
    with ProcessGroup(work) as procs:
        f = start_secret_router(procs, cluster, work)
        yield f
        assert f.proc.stop() == 0 and "Traceback" not in f.proc.log(), f.proc.log()[-20000:]


@pytest.fixture
def logs(front, cluster):
    """The router's and the workers' logs from here on must hold no traceback."""
    with no_new_tracebacks([front.proc, *_worker_procs(cluster)]):
        yield


# the credential fuzzers' keyed router and secret-requiring workers (fuzz_auth_support.py), for
# test_fuzz_auth_router.py and test_fuzz_auth_workers.py (one set per module)
from fuzz_auth_support import ended, g  # noqa: E402, F401

# the control-listener fuzzers' router (fuzz_control_support.py), for test_fuzz_control.py and
# test_fuzz_metrics_ports.py (one per module)
from fuzz_control_support import ctl, ended_ctl  # noqa: E402, F401
