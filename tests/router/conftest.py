"""Fixtures of the router tests: one real prefill worker and one real decode worker for the
whole session (subprocesses on loopback ports), and the single-process oracle."""

from __future__ import annotations

import pytest
from helpers_procs import ProcessGroup, free_port
from router_helpers import Cluster, make_oracle, worker_flags


@pytest.fixture(scope="session")
def cluster(tiny_llama, tmp_path_factory):
    """A prefill worker and a decode worker serving the tiny model (block size 4, max_model_len 256)."""
    with ProcessGroup(tmp_path_factory.mktemp("router_cluster")) as procs:
        prefill = procs.prefill_worker(tiny_llama, *worker_flags(), wait=False)
        metrics = free_port()
        decode = procs.decode_worker(
            tiny_llama,
            *worker_flags(),
            "--max-batch-size",
            "8",
            "--metrics-port",
            str(metrics),
            wait=False,
        )
        prefill.wait_serving()
        decode.wait_serving()
        yield Cluster(tiny_llama, prefill.address, decode.address, procs, metrics)
        assert prefill.stop() == 0, prefill.log()
        assert decode.stop() == 0, decode.log()


@pytest.fixture(scope="session")
def oracle(tiny_llama):
    """(prompt ids, SamplingParams) -> the OfflineEngine Completion (tokens, text, finish reason)."""
    return make_oracle(tiny_llama)
