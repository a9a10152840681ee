"""The fuzz suites' router process and their log check, shared by the package's `front`
(conftest.py) and the control-listener suite's `ctl` (fuzz_control_support.py)."""

from __future__ import annotations

import contextlib
import secrets
import time

from fuzz_support import MODEL, Front, _http
from helpers_procs import free_port
from router_helpers import MAX_MODEL_LEN


def start_secret_router(procs, cluster, work, *extra: str) -> Front:
    """A router in front of the suite's workers, with a fresh cluster secret (in
    work/cluster-secret), its HTTP and metrics ports and `extra` flags; returned once its HTTP
    health answers."""
    secret = secrets.token_urlsafe(24)
    (work / "cluster-secret").write_text(secret)
    http_port, metrics = free_port(), free_port()
    proc = procs.router(
        cluster.model,
        *("--prefill", cluster.prefill, "--decode", cluster.decode, "--model-name", MODEL),
        *("--http-port", str(http_port), "--metrics-port", str(metrics)),
        *("--max-model-len", str(MAX_MODEL_LEN), "--cluster-secret-file", str(work / "cluster-secret")),
        *extra,
    )  # fmt: skip
    front = Front(proc, http_port, metrics, secret)
    deadline = time.monotonic() + 30
    while _http(front, "GET", "/health")[0] != 200:
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.1)
    return front


@contextlib.contextmanager
def no_new_tracebacks(procs):
    """What `procs` log inside the block must hold no traceback."""
    marks = [(p, len(p.log_path.read_bytes())) for p in procs]
    yield
    for p, mark in marks:
        tail = p.log_path.read_bytes()[mark:].decode(errors="replace")
        assert "Traceback" not in tail, f"{p.name} logged a traceback:\n{tail[-20000:]}"
