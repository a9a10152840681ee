"""A corrupted KV transfer seen through the OpenAI HTTP front of a real router process: the
prefill worker's test-only `corrupt_payload` fault hits every request, the decode worker checks
the checksum always. Under the recompute policy the non-streamed response body says so
(`"kv_handover": {"recomputed": true, "reason": "checksum", ...}`) and carries the oracle's
text; under the fail policy the client gets a 503 in OpenAI's error shape. Every KV block and
lease is free on both workers at the end."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from fault_helpers import start_worker
from helpers_procs import free_port
from router_helpers import assert_workers_free

from splitserve.request.sampling_params import SamplingParams

PROMPT = [1] + list(range(300, 330))
MAX_TOKENS = 8


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _router(procs, model, prefill: str, decode: str) -> str:
    port = free_port()
    procs.router(
        model, "--prefill", prefill, "--decode", decode, "--http-port", str(port),
        "--model-name", "tiny", "--max-model-len", "256", "--poll-interval-s", "0.2",
    )  # fmt: skip
    return f"http://127.0.0.1:{port}/v1/completions"


def _completion(url: str) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return _post(url, {**body, "ignore_eos": True})


def test_recompute_after_a_corrupt_transfer_is_visible_over_http(cluster, oracle, procs):
    faults = {"transfer": {"corrupt_payload": True}}  # every request id
    prefill, _ = start_worker(procs, "prefill", cluster.model, faults, wait=False)
    again, _ = start_worker(procs, "decode", cluster.model, None, wait=False)  # recompute
    strict, _ = start_worker(
        procs, "decode", cluster.model, None, "--kv-failure-policy", "fail", wait=False
    )
    for w in (prefill, again, strict):
        w.wait_serving()

    # recompute: the body shows it and why; the text is the oracle's
    status, body = _completion(_router(procs, cluster.model, prefill.address, again.address))
    assert status == 200, body
    hand = body["kv_handover"]
    assert hand["recomputed"] is True and hand["reason"] == "checksum", hand
    assert set(hand) == {"recomputed", "reason", "transfer_ms", "streamed", "stream_fallback"}
    assert hand["streamed"] is False, hand
    want = oracle(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    [choice] = body["choices"]
    assert choice["text"] == want.text and choice["finish_reason"] == "length", (choice, want)
    assert body["usage"]["completion_tokens"] == MAX_TOKENS, body["usage"]
    asyncio.run(assert_workers_free([prefill.address], [again.address]))

    # fail: a 5xx in OpenAI's error shape, naming the checksum
    status, body = _completion(_router(procs, cluster.model, prefill.address, strict.address))
    assert status == 503, body
    err = body["error"]
    assert err["type"] == "server_error" and "checksum" in err["message"], err
    assert set(err) >= {"message", "type", "param", "code"}, err
    asyncio.run(assert_workers_free([prefill.address], [strict.address]))
