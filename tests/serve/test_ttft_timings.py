"""Where TTFT goes, end to end: `splitserve serve` (disaggregated, and --colocated) on the tiny
model sends every request's timings on its last chunk (GenerateResponse.timings): each part is
there and >= 0, the TTFT parts add up to no more than the TTFT the client measured and cover
most of it, the gap's parts to no more than the gap; `splitserve bench` splits TTFT and the
second token's gap into those parts in its JSON and table; the router's histogram has the new
component labels. Every test ends with all KV blocks free."""

from __future__ import annotations

import json
import re
import statistics
import time
import urllib.request

import grpc
import pytest
from helpers_procs import all_free
from serve_helpers import ENGINE_FLAGS, run_cli, start_serve

from splitserve.protos import generate_pb2, generate_pb2_grpc, worker_pb2_grpc

TOL_MS = 1.0  # float32 on the wire; the sums are of durations, not of clocks
TTFT_PARTS = ("router_queue_ms", "prefill_queue_ms", "prefill_compute_ms")
TTFT_SUM = (*TTFT_PARTS, "first_token_delivery_ms")
GAP_PARTS = ("handover_ms", "first_decode_step_ms", "second_token_delivery_ms")
NEW_LABELS = ("router_queue", "first_token_delivery", "handover", "first_decode_step")


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def stack(request, tiny_llama, tmp_path_factory):
    mode = ["--colocated"] if request.param == "colocated" else []
    serve = start_serve(
        tmp_path_factory.mktemp(f"ttft_{request.param}"),
        "--model",
        str(tiny_llama),
        "--port",
        "0",
        "--metrics",
        *mode,
        *ENGINE_FLAGS,
    )
    try:
        serve.wait_ready()
        serve.mode = request.param
        yield serve
    finally:
        serve.kill()


def _children(stack) -> dict[str, tuple[str, int]]:
    """name -> (gRPC address, metrics port) from serve's `healthy on` lines."""
    found = re.findall(
        r"^  (\S+)\s+healthy on (\S+) after.* metrics http://127\.0\.0\.1:(\d+)/metrics",
        stack.stderr(),
        re.M,
    )
    return {name: (address, int(port)) for name, address, port in found}


def _assert_all_free(stack) -> None:
    for name, (address, _) in _children(stack).items():
        if name == "router":
            continue
        stub = (
            worker_pb2_grpc.PrefillWorkerStub
            if name.startswith("prefill")
            else worker_pb2_grpc.DecodeWorkerStub
        )
        with grpc.insecure_channel(address) as ch:
            all_free(stub(ch))


def _generate(stub, text: str, max_tokens: int, rid: str):
    """(client TTFT ms, client gap to the second token ms or None, the last chunk)."""
    req = generate_pb2.GenerateRequest(
        request_id=rid,
        text=text,
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    start = time.monotonic()
    ttft = gap = None
    tokens, last = 0, None
    for chunk in stub.Generate(req, timeout=60):
        now = time.monotonic()
        if chunk.token_ids:
            if ttft is None:
                ttft = now - start
            if tokens < 2 <= tokens + len(chunk.token_ids):
                gap = now - start - ttft
            tokens += len(chunk.token_ids)
        last = chunk
    return ttft * 1e3, None if gap is None else gap * 1e3, last


def test_every_request_reports_where_its_ttft_went(stack):
    prompts = ["Disaggregated serving " * 6, "Hello, splitserve", "a b c d e f g h " * 4]
    runs = []
    with grpc.insecure_channel(stack.address) as ch:
        stub = generate_pb2_grpc.GenerateServiceStub(ch)
        for i in range(9):  # one at a time: the client's own hop stays small
            runs.append(_generate(stub, prompts[i % 3], 6, f"ttft-{stack.mode}-{i}"))
        one = _generate(stub, "one token", 1, f"ttft-{stack.mode}-one")  # no second token
    coverage = []
    for ttft, gap, last in runs:
        assert last.finish_reason and last.HasField("timings"), last
        t = last.timings
        values = {f.name: v for f, v in t.ListFields()}
        assert all(v >= 0 for v in values.values()), str(values)
        assert t.prefill_compute_ms > 0, values  # a real forward pass ran on a worker
        router_ttft = sum(getattr(t, k) for k in TTFT_SUM)
        assert router_ttft <= ttft + TOL_MS, (router_ttft, ttft, values)
        coverage.append(router_ttft / ttft)
        assert t.HasField("second_token_gap_ms") and gap is not None
        assert sum(getattr(t, k) for k in GAP_PARTS) <= t.second_token_gap_ms + TOL_MS, values
        if stack.mode == "colocated":  # the decode worker prefilled: no sampling part, no hand-over
            assert t.prefill_sampling_ms == 0 and t.handover_ms == 0, values
            # the whole gap is its step (0 when one chunk carried both tokens)
            assert t.first_decode_step_ms == pytest.approx(t.second_token_gap_ms), values
        else:
            assert 0 < t.prefill_sampling_ms <= t.prefill_compute_ms, values
            assert t.first_decode_step_ms > 0, values  # the decode worker's own figure
    # the router's parts explain most of what the client waited (the rest: its hop to the router)
    assert statistics.median(coverage) >= 0.5, coverage
    _, gap, last = one
    assert gap is None and last.HasField("timings"), last
    assert not last.timings.HasField("second_token_gap_ms"), last.timings
    _assert_all_free(stack)


def test_bench_splits_ttft_into_its_parts(stack, tmp_path):
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
        "6",
        "--request-rate",
        "20",
        "--json-out",
        str(out),
        "--no-progress",
    )
    assert res.returncode == 0, res.stderr
    assert "TTFT Breakdown (ms)" in res.stdout and "first_token_delivery" in res.stdout, res.stdout
    doc = json.loads(out.read_text())
    assert doc["completed"] == 8, doc["errors"]
    ttft_parts = doc["ttft_breakdown"]
    assert set(ttft_parts) == {
        "router_queue",
        "prefill_queue",
        "prefill_compute",
        "prefill_sampling",
        "first_token_delivery",
        "client_hop",
    }
    assert set(doc["token2_breakdown"]) == {
        "second_token_gap",
        "handover",
        "first_decode_step",
        "second_token_delivery",
        "reserve_wait",
    }
    for parts in (ttft_parts, doc["token2_breakdown"]):
        for name, s in parts.items():
            assert set(s) == {"median", "p99", "at_p99"}, name
            assert all(v >= 0 for v in s.values()), (name, s)
    # the parts of the slowest requests add up to their TTFT (client_hop takes the rest)
    at_p99 = sum(s["at_p99"] for k, s in ttft_parts.items() if k != "prefill_sampling")
    assert at_p99 >= doc["ttft_ms"]["p99"] - 0.01, (at_p99, doc["ttft_ms"])
    assert ttft_parts["prefill_compute"]["median"] > 0
    for r in doc["requests"]:
        assert r["timings_ms"]["prefill_compute"] > 0 and "handover" in r["timings_ms"], r
    _assert_all_free(stack)


def test_router_histogram_has_the_new_components(stack):
    _, port = _children(stack)["router"]
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for label in (*NEW_LABELS, "second_token_delivery", "prefill_queue", "prefill_compute"):
        m = re.search(
            rf'^splitserve_router_ttft_component_seconds_count\{{component="{label}"\}} (\S+)',
            page,
            re.M,
        )
        assert m and float(m[1]) > 0, label
    _assert_all_free(stack)
