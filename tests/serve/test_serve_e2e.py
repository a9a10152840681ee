"""`splitserve serve` as a subprocess on the tiny model: concurrent generate calls give the
single-process engine's greedy tokens, `generate` and `bench` work as CLIs against it, the
router's OpenAI HTTP front is on (a free port with --port 0) and printed on the ready line, and
SIGTERM to the launcher stops every child (no orphans). The tests run in file order; the last
one shuts the stack down."""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_helpers import ENGINE_FLAGS, make_oracle, pid_alive, run_cli, start_serve

from splitserve.cli import client
from splitserve.protos import generate_pb2

PROMPTS = [
    ("Hello, splitserve", 12),
    ("The quick brown fox jumps over", 9),
    ("a", 14),
    ("Disaggregated serving " * 4, 7),
]


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    serve = start_serve(
        tmp_path_factory.mktemp("serve_e2e"),
        "--model",
        str(tiny_llama),
        "--port",
        "0",
        "--metrics",
        *ENGINE_FLAGS,
    )
    try:
        serve.wait_ready()
        yield serve
    finally:
        serve.kill()


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    return make_oracle(tiny_llama)


def test_ready_output_names_every_child(stack):
    err = stack.stderr()
    assert set(stack.child_pids()) == {"prefill-0", "decode-0", "router"}, err
    for name in ("prefill-0", "decode-0", "router"):
        assert re.search(rf"^  {name}\s+healthy on 127\.0\.0\.1:\d+ after", err, re.M), err
    assert err.count("/metrics") == 3, err


@pytest.fixture(scope="module")
def transformers_greedy(tiny_llama):
    """(prompt ids, n) -> transformers' greedy continuation on the same checkpoint folder."""
    import torch

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama, dtype=torch.float32
    ).eval()

    def greedy(prompt_ids, n):
        out = model.generate(
            torch.tensor([list(prompt_ids)]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        return out[0, len(prompt_ids) :].tolist()

    return greedy


def test_concurrent_generate_matches_offline_engine(stack, oracle, transformers_greedy):
    def one(case):
        text, n = case
        sp = generate_pb2.SamplingParams(temperature=0.0, max_tokens=n)
        return client.generate(stack.address, client.make_request(text, sp), timeout=60.0)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    for (text, n), got in zip(PROMPTS, results):
        want = oracle(text, n)
        assert got.token_ids == want.token_ids == transformers_greedy(want.prompt_token_ids, n), (
            text
        )
        assert got.text == want.text, text
        assert got.finish_reason == want.finish_reason == "length"
        assert got.usage["completion_tokens"] == n
        assert got.ttft_s is not None and got.ttft_s <= got.e2e_s


def test_generate_cli_streams_text_and_json(stack, oracle):
    text, n = PROMPTS[0]
    want = oracle(text, n)
    plain = run_cli("generate", text, "--address", stack.address, "--max-tokens", str(n))
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == want.text + "\n"
    assert "finish_reason=length" in plain.stderr

    js = run_cli(
        "generate",
        text,
        "--address",
        stack.address,
        "--max-tokens",
        str(n),
        "--json",
        "--logprobs",
        "2",
    )
    assert js.returncode == 0, js.stderr
    doc = json.loads(js.stdout)
    assert doc["token_ids"] == want.token_ids and doc["text"] == want.text
    assert doc["finish_reason"] == "length" and doc["usage"]["completion_tokens"] == n
    assert len(doc["logprobs"]) == n and all(len(lp["top"]) == 2 for lp in doc["logprobs"])


def test_generate_error_is_one_line_with_status(stack):
    bad = run_cli("generate", "hi", "--address", stack.address, "--top-p", "7")
    assert bad.returncode == 1
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "INVALID_ARGUMENT" in lines[0] and "top_p" in lines[0], bad.stderr


def test_bench_writes_summary_json(stack, tmp_path):
    out = tmp_path / "bench.json"
    res = run_cli(
        "bench",
        "--address",
        stack.address,
        "--num-prompts",
        "8",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--request-rate",
        "50",
        "--slo",
        "ttft:60000,tpot:60000",
        "--json-out",
        str(out),
        "--no-progress",
    )
    assert res.returncode == 0, res.stderr
    assert "Serving Benchmark Result" in res.stdout and "Median TTFT (ms)" in res.stdout
    doc = json.loads(out.read_text())
    assert doc["completed"] == 8 and doc["failed"] == 0
    assert doc["total_input_tokens"] == 8 * 16 and doc["total_output_tokens"] == 8 * 8
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(doc[metric]) == {"mean", "median", "p90", "p99"}
        assert all(v is not None and v >= 0 for v in doc[metric].values()), metric
    assert doc["ttft_ms"]["median"] <= doc["e2el_ms"]["median"]
    assert doc["request_throughput"] > 0 and doc["output_throughput"] > 0
    assert doc["goodput"] == pytest.approx(doc["request_throughput"]) and doc["good_requests"] == 8
    assert [r["output_len"] for r in doc["requests"]] == [
        8
    ] * 8  # ignore_eos: every output has its length
    assert doc["config"]["request_rate"] == 50 and doc["server"]["model_name"]


def test_every_service_exports_metrics(stack):
    ports = dict(
        re.findall(
            r"^  (\S+)\s+healthy on .* metrics http://127\.0\.0\.1:(\d+)/metrics",
            stack.stderr(),
            re.M,
        )
    )
    want = {
        "router": "splitserve_router_ttft_seconds_count",
        "prefill-0": "splitserve_prefill_ttft_seconds_count",
        "decode-0": "splitserve_decode_itl_seconds_count",
    }
    for name, metric in want.items():
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{ports[name]}/metrics", timeout=10)
            .read()
            .decode()
        )
        assert re.search(rf"^{metric}(\{{.*\}})? [1-9]", text, re.M), (name, metric)


def test_openai_http_api_is_on_by_default_and_printed(stack, oracle):
    ready = next(line for line in stack.stdout_lines if line.startswith("ready: router on"))
    m = re.search(r"; OpenAI API on (http://127\.0\.0\.1:\d+/v1)$", ready)
    assert m, ready
    with urllib.request.urlopen(m[1].removesuffix("/v1") + "/health", timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
    text, n = PROMPTS[1]
    req = urllib.request.Request(
        m[1] + "/completions",
        data=json.dumps({"prompt": text, "max_tokens": n, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        doc = json.loads(resp.read())
    assert (
        doc["choices"][0]["text"] == oracle(text, n).text and doc["usage"]["completion_tokens"] == n
    )


def test_sigterm_stops_every_child(stack):
    pids = stack.child_pids()
    assert all(pid_alive(p) for p in pids.values())
    assert stack.terminate(timeout=90) == 0, stack.stderr()
    assert not [n for n, p in pids.items() if pid_alive(p)], stack.stderr()
    assert "stopped" in stack.stderr().splitlines()[-1]
