"""Streams cut short through the official `openai` client: a client that disconnects mid-stream
(or times out before the answer) cancels the request on every worker, which frees all its KV
blocks; SIGTERM lets an HTTP stream finish, then the router exits 0; a worker failing
mid-stream is an error event, then 503s."""

from __future__ import annotations

import signal
import time

import openai
import pytest
from helpers_procs import free_port
from openai_helpers import MAX_MODEL_LEN, MODEL, http, still_serving, worker_flags

MSGS = [{"role": "user", "content": "Hello"}]


def _outcome(stack, name: str) -> float:
    return stack.metric(f'splitserve_router_requests_total{{outcome="{name}"}}')


def test_disconnect_mid_stream_frees_every_block_on_every_worker(stack, client, oracle):
    cancelled = _outcome(stack, "cancelled")
    aborted = stack.decode_finished("abort")
    gone = stack.metric(
        'splitserve_router_http_requests_total{route="/v1/completions",status="499"}'
    )
    tokens_before = stack.metric("splitserve_router_completion_tokens_total")
    prompt = [1, 44, 45, 46, 200, 201, 202]
    n = MAX_MODEL_LEN - len(prompt)  # up to max_model_len: seconds of decoding on this machine
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = [next(stream) for _ in range(3)]
    stream.close()  # the connection goes away mid-stream
    deadline = time.monotonic() + 10
    while _outcome(stack, "cancelled") < cancelled + 1:
        assert time.monotonic() < deadline, "the router did not see the disconnect"
        time.sleep(0.05)
    stack.assert_free()
    assert (
        stack.decode_finished("abort") == aborted + 1
    )  # the disconnect reached the decode worker as a cancel
    assert all(c.choices[0].finish_reason is None for c in got)
    assert stack.metric("splitserve_router_completion_tokens_total") - tokens_before < n
    assert (
        stack.metric('splitserve_router_http_requests_total{route="/v1/completions",status="499"}')
        == gone + 1
    )

    # a chat stream, and a non-streamed request whose client gives up before the answer
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_completion_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(chat), next(chat)
    chat.close()
    timed_out = 0
    for timeout in (
        0.3,
        0.15,
    ):  # seconds of decoding left either way, unless the machine is very fast
        try:
            client.with_options(timeout=timeout).completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=n,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        except openai.APITimeoutError:
            timed_out = 1
            break
    assert timed_out
    deadline = time.monotonic() + 10
    while _outcome(stack, "cancelled") < cancelled + 3:
        assert time.monotonic() < deadline, "the router did not see both disconnects"
        time.sleep(0.05)
    stack.assert_free()
    still_serving(client)
    stack.assert_free()


def _http_router(stack, decode: str, *more: str, name: str):
    """Another router process (OpenAI HTTP on a free port) over the stack's prefill worker and
    the decode worker at `decode`, `more` flags added: (the process, its http://127.0.0.1:PORT)."""
    port = free_port()
    args = ["--prefill", stack.prefill, "--decode", decode, "--http-port", str(port)]
    args += ["--model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), *more]
    return stack.procs.router(stack.model, *args, name=name), f"http://127.0.0.1:{port}"


def test_sigterm_lets_http_streams_finish_then_exits(stack):
    router, base = _http_router(
        stack, stack.decode, "--drain-grace-s", "30", name="draining-router"
    )
    assert http("GET", base + "/health")[0] == 200
    with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        stream = c.completions.create(
            model=MODEL,
            prompt=[1, 60, 61, 62],
            max_tokens=80,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        first = next(stream)
        router.proc.send_signal(signal.SIGTERM)
        rest = list(stream)
    assert router.proc.wait(30) == 0, router.log()
    assert rest[-1].usage.completion_tokens == 80 and rest[-2].choices[0].finish_reason == "length"
    assert first.choices[0].finish_reason is None
    with pytest.raises(OSError):  # no longer listening
        http("GET", base + "/health", timeout=5)
    assert "Traceback" not in router.log()
    stack.assert_free()


def test_worker_failure_mid_stream_is_an_error_event_then_503s(stack):
    decode = stack.procs.decode_worker(stack.model, *worker_flags(), name="doomed-decode")
    _, base = _http_router(stack, decode.address, name="doomed-router")
    with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        stream = c.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_completion_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(stream)
        decode.kill()
        with pytest.raises(openai.APIError) as info:
            list(stream)
        with pytest.raises(openai.InternalServerError) as after:
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert first.choices[0].delta.role == "assistant"
    assert (
        info.value.body["code"] == "unavailable"
        and "cannot be resumed" in info.value.body["message"]
    )
    assert (
        after.value.status_code == 503 and "no healthy decode worker" in after.value.body["message"]
    )
    stack.assert_free()  # the prefill worker's lease went with the pull or the router's release
