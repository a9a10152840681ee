"""The official `openai` client against the router's HTTP front (real router, prefill and decode
processes): completions and chat, streamed and not, give the single-process engine's greedy
text, the gRPC Generate's text on the same router, the same seeded samples through both APIs,
right usage (cached prompt tokens included), finish reasons and logprobs; /v1/models, /health
and /metrics answer; `splitserve bench --backend openai` runs. Every test ends with all KV free."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers_procs import cli_command
from openai_helpers import BLOCK_SIZE, MODEL

from splitserve.protos import generate_pb2
from splitserve.request.sampling_params import SamplingParams

PROMPT = "The quick brown fox jumps over"
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Where does the quick brown fox jump?"},
]


@pytest.fixture(scope="module")
def chat_ids(tiny_llama):
    """The prompt ids of MESSAGES as transformers' apply_chat_template makes them (the oracle)."""
    from transformers import AutoTokenizer

    got = AutoTokenizer.from_pretrained(tiny_llama).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True
    )
    return list(got["input_ids"] if hasattr(got, "keys") else got)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def _joined(chunks, chat: bool = False) -> str:
    if chat:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _check_stream_shape(chunks, finish: str, usage=None) -> None:
    *body, tail = chunks
    assert (
        tail.choices == [] and tail.usage is not None
    )  # include_usage: the last chunk, no choices
    assert all(c.usage is None for c in body)
    assert body[-1].choices[0].finish_reason == finish
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert len({c.id for c in chunks}) == 1
    if usage is not None:
        assert tail.usage.model_dump() == usage.model_dump()


def test_completions_greedy_equal_offline_engine_and_grpc(stack, client, oracle):
    ids = oracle.tokenizer.encode(PROMPT)
    ref = oracle(ids, _greedy(12))
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    streamed = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    chunks = stack.grpc_generate(PROMPT, generate_pb2.SamplingParams(temperature=0, max_tokens=12))

    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert text.choices[0].text == by_ids.choices[0].text == _joined(streamed) == ref.text
    assert ref.text == "".join(c.text for c in chunks)
    assert text.object == "text_completion" and text.model == MODEL and text.id.startswith("cmpl-")
    assert text.choices[0].finish_reason == by_ids.choices[0].finish_reason == "length"
    u = text.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), 12, len(ids) + 12)
    assert u.prompt_tokens_details.cached_tokens % BLOCK_SIZE == 0
    _check_stream_shape(streamed, "length")
    assert streamed[-1].usage.completion_tokens == 12 and streamed[-1].usage.prompt_tokens == len(
        ids
    )
    # the hand-over is reported on the last chunk / the whole response: pulled, not recomputed
    assert chunks[-1].HasField("kv_handover") and not chunks[-1].kv_handover.recomputed
    assert chunks[-1].kv_handover.transfer_ms > 0 and not chunks[-1].kv_handover.reason
    finish_chunk = next(c for c in streamed if c.choices and c.choices[0].finish_reason)
    for body in (text, finish_chunk):
        handover = body.model_extra["kv_handover"]
        assert handover["recomputed"] is False and handover["reason"] == "", handover
        assert handover["streamed"] is True and handover["stream_fallback"] == "", handover
    assert all("kv_handover" not in c.model_extra for c in streamed if c is not finish_chunk)
    stack.assert_free()


def test_chat_greedy_equals_offline_engine_on_the_rendered_template(
    stack, client, oracle, chat_ids
):
    ref = oracle(chat_ids, _greedy(10))
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0
    )
    old_name = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0
    )
    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    same_ids = client.completions.create(model=MODEL, prompt=chat_ids, max_tokens=10, temperature=0)

    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text
    assert (
        old_name.choices[0].message.content
        == same_ids.choices[0].text
        == _joined(streamed, chat=True)
        == ref.text
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(chat_ids), 10)
    assert streamed[0].object == "chat.completion.chunk"
    assert (
        streamed[0].choices[0].delta.role == "assistant"
        and streamed[0].choices[0].delta.content == ""
    )
    _check_stream_shape(streamed, "length")
    assert (
        streamed[-1].usage.prompt_tokens == len(chat_ids)
        and streamed[-1].usage.completion_tokens == 10
    )
    stack.assert_free()


def test_stop_strings_end_with_finish_reason_stop(stack, client, oracle, chat_ids):
    ids = oracle.tokenizer.encode(PROMPT)
    probe = oracle(ids, _greedy(20))
    stop = probe.text[6:9].strip() or probe.text[6:9]
    ref = oracle(ids, _greedy(20, stop=(stop,)))
    assert ref.finish_reason == "stop"
    one = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=stop
    )
    listed = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stop=["never-there", stop],
            stream=True,
        )
    )
    assert one.choices[0].text == _joined(listed) == ref.text
    assert one.choices[0].finish_reason == listed[-1].choices[0].finish_reason == "stop"
    assert one.usage.completion_tokens == len(ref.token_ids) < 20

    chat_probe = oracle(chat_ids, _greedy(20))
    chat_stop = chat_probe.text[4:7].strip() or chat_probe.text[4:7]
    chat_ref = oracle(chat_ids, _greedy(20, stop=(chat_stop,)))
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0, stop=[chat_stop]
    )
    assert (
        chat.choices[0].message.content == chat_ref.text and chat.choices[0].finish_reason == "stop"
    )
    stack.assert_free()


def test_seeded_sampling_is_identical_across_the_two_apis_and_grpc(stack, client, oracle, chat_ids):
    # values exact in float32 (the wire type), so the oracle samples with the very same numbers
    knobs = dict(
        temperature=0.75, top_p=0.875, seed=1234, presence_penalty=0.25, frequency_penalty=0.125
    )
    extra = dict(top_k=40, min_p=0.0625, repetition_penalty=1.125)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=16, extra_body=extra, **knobs
    )
    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=16,
            extra_body=extra,
            stream=True,
            **knobs,
        )
    )
    comp = client.completions.create(
        model=MODEL, prompt=chat_ids, max_tokens=16, extra_body=extra, **knobs
    )
    chunks = stack.grpc_generate(
        chat_ids, generate_pb2.SamplingParams(max_tokens=16, **knobs, **extra)
    )
    ref = oracle(chat_ids, SamplingParams(max_tokens=16, **knobs, **extra))
    other_seed = client.completions.create(
        model=MODEL, prompt=chat_ids, max_tokens=16, extra_body=extra, **{**knobs, "seed": 4321}
    )

    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert (
        chat.choices[0].message.content
        == _joined(streamed, chat=True)
        == comp.choices[0].text
        == ref.text
    )
    assert "".join(c.text for c in chunks) == ref.text
    assert chat.usage.completion_tokens == comp.usage.completion_tokens == len(ref.token_ids)
    assert other_seed.choices[0].text != ref.text  # the seed does matter
    stack.assert_free()


def test_logprobs_follow_the_tokens_in_both_apis(stack, client, oracle, chat_ids):
    ids = oracle.tokenizer.encode(PROMPT)
    ref = oracle(ids, _greedy(6, logprobs=2))
    comp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    )
    assert lp.tokens == [
        oracle.tokenizer.token_bytes(t).decode(errors="replace") for t in ref.token_ids
    ]
    assert all(abs(a - b.logprob) < 1e-4 for a, b in zip(lp.token_logprobs, ref.logprobs))
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    chat_ref = oracle(chat_ids, _greedy(6, logprobs=2))
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=6,
            temperature=0,
            logprobs=True,
            stream=True,
        )
    )
    content = chat.choices[0].logprobs.content
    assert [bytes(c.bytes) for c in content] == [
        oracle.tokenizer.token_bytes(t) for t in chat_ref.token_ids
    ]
    assert all(abs(c.logprob - r.logprob) < 1e-4 for c, r in zip(content, chat_ref.logprobs))
    assert all(
        len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        for c in content
    )
    per_chunk = [
        c
        for ch in streamed
        if ch.choices and ch.choices[0].logprobs
        for c in ch.choices[0].logprobs.content
    ]
    assert [c.token for c in per_chunk] == [c.token for c in content]
    assert all(
        c.top_logprobs == [] for c in per_chunk
    )  # logprobs without top_logprobs: the token's own only
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=2, temperature=0
    )
    assert plain.choices[0].logprobs is None
    stack.assert_free()


def test_usage_counts_cached_prompt_tokens(stack, client):
    prompt = [1] + list(range(150, 190))  # 41 tokens: 10 full blocks of 4, in no other test
    cold = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    warm = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    usage = warm[-1].usage
    assert (
        usage.prompt_tokens == 41 and usage.prompt_tokens_details.cached_tokens == 10 * BLOCK_SIZE
    )
    assert usage.total_tokens == 43
    stack.assert_free()


def test_models_health_and_metrics_share_the_router(stack, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "splitserve"
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == 256
    status, health, _ = stack.get("/health")
    assert status == 200 and health == {"status": "ok", "healthy_prefill": 1, "healthy_decode": 1}

    ttft = "splitserve_router_ttft_seconds_count"
    ok = 'splitserve_router_http_requests_total{route="/v1/completions",status="200"}'
    before = (
        stack.metric(ttft),
        stack.metric(ok),
        stack.metric('splitserve_router_requests_total{outcome="length"}'),
    )
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    stack.grpc_generate("Hi", generate_pb2.SamplingParams(temperature=0, max_tokens=3))
    after = (
        stack.metric(ttft),
        stack.metric(ok),
        stack.metric('splitserve_router_requests_total{outcome="length"}'),
    )
    assert after[0] == before[0] + 2 and after[1] == before[1] + 1 and after[2] == before[2] + 2
    status, page, headers = stack.get("/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    stack.assert_free()


def test_bench_openai_backend_reports_the_same_metrics(stack, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            *cli_command("bench"),
            "--backend",
            "openai",
            "--base-url",
            stack.base_url + "/v1",
            "--num-prompts",
            "4",
            "--input-len",
            "12",
            "--output-len",
            "6",
            "--max-concurrency",
            "2",
            "--no-progress",
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["backend"] == "openai" and doc["completed"] == 4 and doc["failed"] == 0
    assert doc["total_input_tokens"] == 4 * 12 and doc["total_output_tokens"] == 4 * 6
    assert doc["ttft_ms"]["mean"] is not None and doc["e2el_ms"]["mean"] >= doc["ttft_ms"]["mean"]
    assert doc["server"]["model_name"] == MODEL and doc["server"]["healthy_workers"] == {
        "prefill": 1,
        "decode": 1,
    }
    assert "over openai" in done.stderr and "Time to First Token" in done.stdout
    stack.assert_free()
