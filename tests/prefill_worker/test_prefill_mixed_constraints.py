"""Token 0 of a packed prefill batch with constrained and unconstrained rows (the prefill
worker's sampler, prefill_step.py): the unconstrained rows get the tokens and logprobs they get
without the constrained ones beside them, and each constrained row's token is one its matcher
allows (CPU, tiny model with random weights)."""

from __future__ import annotations

import json

import pytest
from prefill_helpers import worker_config

from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.sampler import Sampler, SeqSamplingInfo
from splitserve.request.constraint import Constraint
from splitserve.request.grammar_cache import GrammarCache
from splitserve.request.sampling_params import SamplingParams

PROMPTS = [[1, 33, 44, 55], [1] + list(range(60, 90)), [1, 7, 9], [1, 200, 201, 202, 203, 204]]


def test_unconstrained_rows_keep_their_token_zero_beside_constrained_ones(tiny_llama):
    cfg = worker_config(tiny_llama)
    runner = ModelRunner(cfg.engine)
    bs, table, chunks = runner.block_size, 1, []
    for p in PROMPTS:  # one packed varlen step, each prompt in its own blocks
        n = -(-len(p) // bs)
        chunks.append(PrefillChunk(p, 0, list(range(table, table + n))))
        table += n
    logits = runner.prefill(chunks)
    vocab = logits.shape[1]
    eos = json.loads((tiny_llama / "config.json").read_text())["eos_token_id"]
    grammars = GrammarCache(tiny_llama, vocab, [eos])
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    cons = [
        Constraint(kind="regex", text="[q-z]{2,4}"),
        Constraint(kind="json_schema", text=json.dumps(schema)),
    ]
    free = SamplingParams(temperature=1.0, seed=77, logprobs=3, max_tokens=4)
    greedy = SamplingParams(temperature=0.0, logprobs=2, max_tokens=4)

    def info(i: int, params: SamplingParams, c: Constraint | None = None) -> SeqSamplingInfo:
        m = None if c is None else grammars.compile_now(c)
        p = params if c is None else SamplingParams(temperature=1.0, seed=i, constraint=c)
        return SeqSamplingInfo(p, PROMPTS[i], [], m)

    alone = Sampler(seed=5).sample(logits[[0, 2]], [info(0, free), info(2, greedy)])
    mixed_rows = [info(0, free), info(1, free, cons[0]), info(2, greedy), info(3, free, cons[1])]
    mixed = Sampler(seed=5).sample(logits, mixed_rows)
    assert [mixed.token_ids[0], mixed.token_ids[2]] == alone.token_ids
    for got, want in zip((mixed.logprobs[0], mixed.logprobs[2]), alone.logprobs):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    for i in (1, 3):  # a fresh matcher of the row's constraint takes its token 0
        assert grammars.compile_now(cons[i // 2]).consume_token(mixed.token_ids[i]), i
    tok = grammars.tokenizer()
    assert tok.decode_str([mixed.token_ids[3]]).startswith("{")
