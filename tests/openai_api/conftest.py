"""Fixtures of the OpenAI API tests: one real prefill worker, one real decode worker and a real
`splitserve router --http-port` process for the whole session; the official `openai` client
pointed at it; the single-process oracle."""

from __future__ import annotations

import pytest
from helpers_procs import ProcessGroup, free_port
from openai_helpers import MAX_MODEL_LEN, Stack, make_oracle, worker_flags


@pytest.fixture(scope="session")
def stack(tiny_llama, tmp_path_factory):
    with ProcessGroup(tmp_path_factory.mktemp("openai_stack")) as procs:
        prefill = procs.prefill_worker(tiny_llama, *worker_flags(), wait=False)
        decode_metrics = free_port()
        decode = procs.decode_worker(
            tiny_llama,
            *worker_flags(),
            "--max-batch-size",
            "8",
            "--metrics-port",
            str(decode_metrics),
            wait=False,
        )
        prefill.wait_serving()
        decode.wait_serving()
        http_port = free_port()
        router = procs.router(
            tiny_llama,
            "--prefill",
            prefill.address,
            "--decode",
            decode.address,
            "--http-port",
            str(http_port),
            "--model-name",
            "tiny",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--poll-interval-s",
            "0.2",
        )
        st = Stack(
            tiny_llama,
            prefill.address,
            decode.address,
            router.address,
            f"http://127.0.0.1:{http_port}",
            procs,
            decode_metrics,
        )
        st.wait_http_healthy()
        yield st
        assert router.stop() == 0, router.log()
        assert "Traceback" not in router.log(), router.log()
        assert prefill.stop() == 0, prefill.log()
        assert decode.stop() == 0, decode.log()


@pytest.fixture(scope="session")
def client(stack):
    import openai

    with openai.OpenAI(
        base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


@pytest.fixture(scope="session")
def oracle(tiny_llama):
    return make_oracle(tiny_llama)
