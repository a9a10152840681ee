"""Rows whose matchers stand in one state share one mask fill (decode_worker/token_masks.py):
the outputs are those of filling every row, and only rows with the same constraint and the
same tokens so far share (CPU, tiny model with random weights)."""

from __future__ import annotations

import json

from decode_helpers import Collected, assert_all_free, drive, make_engine
from structured_schemas import check_instance, schemas

from splitserve.decode_worker import token_masks
from splitserve.decode_worker.sequence import DecodeInput, DecodeSequence
from splitserve.request.constraint import Constraint
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.stop_checker import StopChecker
from splitserve.request.tokenizer import Tokenizer

PROMPT = [5, 17, 33, 9, 2, 41]


def _requests(tiny_llama):
    one, other = (
        (s, Constraint(kind="json_schema", text=json.dumps(s))) for s in schemas(seed=9, count=2)
    )
    greedy = {"temperature": 0.0, "max_tokens": 120}
    return (
        one,
        other,
        {
            # a and b: same schema, prompt and greedy tokens: one state all along
            "a": SamplingParams(constraint=one[1], **greedy),
            "b": SamplingParams(constraint=one[1], **greedy),
            # c: same schema, sampled: shares the forced opening, then diverges
            "c": SamplingParams(constraint=one[1], temperature=1.0, seed=3, max_tokens=120),
            "d": SamplingParams(constraint=other[1], **greedy),
            "free": SamplingParams(temperature=1.0, seed=5, max_tokens=40),
        },
    )


def _run(tiny_llama, reqs):
    engine, col = make_engine(tiny_llama), Collected()
    fns = []
    for rid, params in reqs.items():
        m = None if params.constraint is None else engine.grammars.compile_now(params.constraint)
        inp = DecodeInput(rid, PROMPT, None, params, m)
        fns.append(lambda inp=inp, rid=rid: engine.submit(inp, col.sink(rid)))
    drive(engine, {0: fns})
    assert_all_free(engine)
    return engine, col


def test_shared_fills_give_the_tokens_of_separate_fills(tiny_llama, monkeypatch):
    one, other, reqs = _requests(tiny_llama)
    engine, shared = _run(tiny_llama, reqs)
    assert engine.graphs.masks.shared_rows > 20  # b beside a on every step, c at the start
    with monkeypatch.context() as mp:
        mp.setattr(token_masks, "same_state", lambda seqs, ms: [None] * len(seqs))
        alone_engine, alone = _run(tiny_llama, reqs)
    assert alone_engine.graphs.masks.shared_rows == 0
    text = Tokenizer.from_dir(tiny_llama).decode
    for rid in reqs:
        assert shared.tokens[rid] == alone.tokens[rid], rid
    assert shared.tokens["a"] == shared.tokens["b"]
    for rid, (schema, _) in (("a", one), ("c", one), ("d", other)):
        assert shared.final[rid].finish_reason == "stop", rid
        check_instance(json.loads(text(shared.tokens[rid])), schema)


class _TakesAll:
    """Stands in for a matcher in `same_state`'s bookkeeping: it takes every token."""

    def consume_token(self, token: int) -> bool:
        return True


def _seq(params, tokens, fp=None):
    s = DecodeSequence("r", PROMPT, params, StopChecker(params, [2], 4096, 6), lambda out: None)
    s.start_grammar(_TakesAll())
    for t in tokens:
        s.output_token_ids.append(t)
        assert s.advance_matcher(t)
    if fp is not None:
        s.grammar_fp = fp
    return s


def test_only_one_constraint_and_the_same_tokens_share():
    a = Constraint(kind="regex", text="[a-z]{1,9}")
    b = Constraint(kind="regex", text="[a-y]{1,9}")
    pa, pb = SamplingParams(constraint=a), SamplingParams(constraint=b)
    rows = [_seq(pa, [4, 5]), _seq(pa, [4, 5]), _seq(pa, [4, 6]), _seq(pb, [4, 5])]
    rows.append(_seq(pa, [5, 4], fp=rows[0].grammar_fp))  # a fingerprint collision
    rows.append(_seq(pa, [4, 5]))
    matchers = [s.matcher for s in rows]
    assert token_masks.same_state(rows, matchers) == [None, 0, None, None, None, 0]
    matchers[0] = None  # a finished row shares nothing; the next one of its state leads
    assert token_masks.same_state(rows, matchers) == [None, None, None, None, None, 1]
