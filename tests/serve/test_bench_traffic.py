"""`splitserve bench --traffic realistic` and per-request sampling: the generator's mix (shares,
long tails, multi-turn prefixes, lengths within the cap, reproducible), a dataset row's
"sampling" object (checked up front, one line naming the row), and end to end that every
request's sampling fields reach the workers: through a real `serve`, a seeded sampled row with
penalties and a greedy row give exactly the single-process engine's tokens for those
parameters, and the seeded one differs from greedy. Ends with all KV blocks free."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from helpers_procs import all_free
from serve_helpers import ENGINE_FLAGS, MAX_MODEL_LEN, run_cli, start_serve

from splitserve.cli.bench.traffic import describe, realistic_prompts
from splitserve.cli.bench.workload import BenchConfig, make_prompts, write_jsonl
from splitserve.protos import worker_pb2_grpc
from splitserve.request.tokenizer import Tokenizer


def test_mix_shares_tails_and_caps():
    prompts = realistic_prompts(2000, 128256, seed=3, max_len=8192)
    assert len(prompts) == 2000
    assert prompts == realistic_prompts(2000, 128256, seed=3, max_len=8192)  # seeded
    assert prompts != realistic_prompts(2000, 128256, seed=4, max_len=8192)
    mix = describe(prompts)
    share = {k: v / 2000 for k, v in mix["sampling"].items()}
    assert abs(share["sampled"] - 0.7) < 0.05 and abs(share["greedy"] - 0.2) < 0.04
    assert abs(share["seeded_penalties"] - 0.1) < 0.03
    assert mix["kinds"]["chat"] > mix["kinds"]["coding"] > 0 and mix["kinds"]["chat-turn"] > 50
    lens = np.array([len(p.prompt) for p in prompts])
    assert np.percentile(lens, 99) > 8 * np.median(lens)  # a long tail
    assert all(
        len(p.prompt) + p.output_len <= 8192 and all(t < 128256 for t in p.prompt) for p in prompts
    )
    for p in prompts:
        s = p.sampling
        if p.kind.endswith("greedy"):
            assert s == {"temperature": 0.0}
        elif p.kind.endswith("sampled"):
            assert s == {"temperature": 0.7, "top_p": 0.95}
        else:
            assert s["seed"] >= 0 and s["repetition_penalty"] > 1 and s["presence_penalty"] > 0


def test_later_turns_extend_an_earlier_turn():
    prompts = realistic_prompts(600, 5000, seed=1, max_len=4096)
    turns = [p for p in prompts if p.kind.startswith("chat-turn")]
    assert turns
    for turn in turns:
        earlier = [
            q
            for q in prompts[: prompts.index(turn)]
            if len(q.prompt) < len(turn.prompt) and turn.prompt[: len(q.prompt)] == q.prompt
        ]
        assert earlier, "a later turn shares an earlier request's whole prompt as its prefix"
        assert earlier[-1].sampling == turn.sampling  # one conversation, one client setting


def test_small_context_clips_and_refuses():
    for cap in (5, 6, 64):
        prompts = realistic_prompts(300, 1000, seed=0, max_len=cap)
        assert all(len(p.prompt) + p.output_len <= cap for p in prompts), cap
    with pytest.raises(ValueError, match="too short"):
        realistic_prompts(3, 1000, seed=0, max_len=3)


def _cfg(**kw) -> BenchConfig:
    return BenchConfig(address="x:1", **kw)


def test_dataset_sampling_rows_and_one_line_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        '{"prompt_token_ids": [1, 2, 3], "output_len": 4, "sampling": {"temperature": 0.8, '
        '"seed": 7, "presence_penalty": 0.5, "top_k": 20}}\n{"prompt": "hi"}\n'
    )
    rows = make_prompts(_cfg(dataset=str(good), num_prompts=2), 100)
    assert rows[0].sampling == {"temperature": 0.8, "seed": 7, "presence_penalty": 0.5, "top_k": 20}
    assert rows[1].sampling is None
    for bad, says in (
        ('{"prompt": "x", "sampling": {"temp": 1}}', "unknown keys ['temp']"),
        ('{"prompt": "x", "sampling": {"top_p": 1.5}}', "sampling.top_p"),
        ('{"prompt": "x", "sampling": [0.7]}', '"sampling" must be an object'),
    ):
        path = tmp_path / "bad.jsonl"
        path.write_text('{"prompt": "fine"}\n' + bad + "\n")
        with pytest.raises(ValueError) as err:
            make_prompts(_cfg(dataset=str(path), num_prompts=2), 100)
        assert (
            f"{path}:2:" in str(err.value) and says in str(err.value) and "\n" not in str(err.value)
        )
    with pytest.raises(ValueError, match="not both"):
        BenchConfig.from_args(
            SimpleNamespace(**{**_args(), "dataset": str(good), "traffic": "realistic"}), "x:1"
        )


def _args() -> dict:
    return dict(
        backend="grpc",
        num_prompts=1,
        dataset=None,
        input_len=4,
        output_len=4,
        request_rate=float("inf"),
        burstiness=1.0,
        max_concurrency=None,
        no_ignore_eos=False,
        temperature=0.0,
        seed=0,
        num_warmups=0,
        timeout=60.0,
        slo=None,
    )


def test_traffic_out_round_trips(tmp_path):
    prompts = realistic_prompts(50, 900, seed=2, max_len=512)
    path = tmp_path / "t.jsonl"
    write_jsonl(path, prompts)
    again = make_prompts(_cfg(dataset=str(path), num_prompts=50), 900)
    assert [(p.prompt, p.output_len, p.sampling) for p in again] == [
        (p.prompt, p.output_len, p.sampling) for p in prompts
    ]


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    serve = start_serve(
        tmp_path_factory.mktemp("traffic"), "--model", str(tiny_llama), "--port", "0", *ENGINE_FLAGS
    )
    try:
        serve.wait_ready()
        yield serve
    finally:
        serve.kill()


def _offline(model, prompt: list[int], n: int, **sampling) -> list[int]:
    from splitserve.config.engine_config import EngineConfig
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.offline import OfflineEngine
    from splitserve.request.sampling_params import SamplingParams
    from splitserve.request.tokenizer import Tokenizer

    runner = ModelRunner(
        EngineConfig(
            model_path=str(model),
            device="cpu",
            cache={"num_blocks": 256, "block_size": 16},
            scheduler={"max_model_len": MAX_MODEL_LEN},
        )
    )
    engine = OfflineEngine(runner, Tokenizer.from_dir(model))
    params = SamplingParams(max_tokens=n, ignore_eos=True, **sampling)
    return list(engine.generate([prompt], [params])[0].token_ids)


def test_each_requests_sampling_reaches_the_workers(stack, tiny_llama, tmp_path):
    prompt = [1, 17, 230, 41, 99, 8, 301, 77, 5, 12]
    seeded = {
        "temperature": 0.9,
        "top_k": 40,
        "seed": 1234,
        "presence_penalty": 0.6,
        "frequency_penalty": 0.4,
        "repetition_penalty": 1.3,
    }
    rows = [
        {"prompt_token_ids": prompt, "output_len": 12, "sampling": seeded},
        {"prompt_token_ids": prompt, "output_len": 12, "sampling": {"temperature": 0.0}},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def rows_through(*backend: str, saved: str) -> dict:
        """Both rows sent by bench over `backend` (the run's --temperature 1.0 beside them);
        each request's `saved` output by index."""
        out = tmp_path / "b.json"
        res = run_cli(
            "bench", *backend, "--dataset", str(data), "--num-prompts", "2", "--num-warmups",
            "0", "--temperature", "1.0", "--save-outputs", "--json-out", str(out), "--no-progress",
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        return {r["index"]: r[saved] for r in json.loads(out.read_text())["requests"]}

    got = rows_through("--address", stack.address, saved="output_token_ids")
    want_seeded = _offline(tiny_llama, prompt, 12, **seeded)
    want_greedy = _offline(tiny_llama, prompt, 12, temperature=0.0)
    assert got[0] == want_seeded and got[1] == want_greedy
    assert want_seeded != want_greedy  # the row's fields, not the run's --temperature 1.0, ruled
    # the same rows over the OpenAI HTTP front (OpenAI's names plus vLLM's extras): same text
    http = next(
        m[1] for line in stack.stdout_lines if (m := re.search(r"OpenAI API on (\S+)", line))
    )
    texts = rows_through("--backend", "openai", "--base-url", http, saved="output_text")
    tok = Tokenizer.from_dir(tiny_llama)
    assert texts == {0: tok.decode(want_seeded), 1: tok.decode(want_greedy)}
    realistic = tmp_path / "r.json"
    res = run_cli(
        "bench",
        "--address",
        stack.address,
        "--traffic",
        "realistic",
        "--num-prompts",
        "12",
        "--request-rate",
        "50",
        "--num-warmups",
        "0",
        "--json-out",
        str(realistic),
        "--traffic-out",
        str(tmp_path / "sent.jsonl"),
        "--no-progress",
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(realistic.read_text())
    assert doc["completed"] == 12 and doc["config"]["traffic"] == "realistic"
    assert sum(doc["server"]["traffic"]["sampling"].values()) == 12
    assert len((tmp_path / "sent.jsonl").read_text().splitlines()) == 12
    assert "realistic traffic:" in res.stderr
    for stub in _worker_stubs(stack):
        all_free(stub)


def _worker_stubs(stack):
    for name, address in re.findall(r"^  (\S+)\s+healthy on (\S+) after", stack.stderr(), re.M):
        if name == "router":
            continue
        ch = grpc.insecure_channel(address)
        kind = (
            worker_pb2_grpc.PrefillWorkerStub
            if name.startswith("prefill")
            else worker_pb2_grpc.DecodeWorkerStub
        )
        yield kind(ch)
