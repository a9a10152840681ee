"""Structured output in the decode engine (CPU, tiny model with random weights: only the
constraint makes the output parse): colocated first token, handed-over first token, mixed
batches, preemption, max_tokens."""

from __future__ import annotations

import json
import re

import pytest
from decode_helpers import (
    Collected,
    assert_all_free,
    drive,
    engine_config,
    make_engine,
    submit,
)
from structured_schemas import check_instance, schemas

from splitserve.decode_worker.sequence import DecodeInput
from splitserve.request.constraint import Constraint
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.tokenizer import Tokenizer

PROMPT = [5, 17, 33, 9, 2, 41]


def _params(c: Constraint | None, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 120)
    return SamplingParams(constraint=c, **kw)


def _text(model, ids) -> str:
    return Tokenizer.from_dir(model).decode(ids)


def _run(engine, reqs):
    """reqs: rid -> (params, with_kv, first token or None); all submitted at step 0."""
    col = Collected()
    fns = []
    for rid, (params, with_kv, first) in reqs.items():
        if first is None:
            inp = DecodeInput(rid, PROMPT, None, params, _matcher(engine, params))
            fns.append(lambda inp=inp, rid=rid: engine.submit(inp, col.sink(rid)))
        else:
            fns.append(
                lambda rid=rid, p=params, k=with_kv, f=first: submit(
                    engine, col, rid, PROMPT, f, p, k
                )
            )
    drive(engine, {0: fns})
    return col


def _matcher(engine, params):
    return None if params.constraint is None else engine.grammars.compile_now(params.constraint)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schemas_parse_and_validate_colocated(tiny_llama, temperature):
    engine = make_engine(tiny_llama, max_batch_size=8)
    cases = schemas(seed=1, count=8)
    reqs = {
        f"s{i}": (
            _params(
                Constraint(kind="json_schema", text=json.dumps(s)), temperature=temperature, seed=i
            ),
            False,
            None,
        )
        for i, s in enumerate(cases)
    }
    col = _run(engine, reqs)
    for i, s in enumerate(cases):
        out = col.final[f"s{i}"]
        assert out.finish_reason == "stop", (i, out, _text(tiny_llama, col.tokens[f"s{i}"]))
        value = json.loads(_text(tiny_llama, col.tokens[f"s{i}"]))
        check_instance(value, s)
    assert engine.graphs.masks.steps > 0
    assert_all_free(engine)


def _same_logprobs(got, want) -> None:
    """Logprobs of the same tokens, in batches of other sizes: equal up to float rounding."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [x for _, x in g.top] == pytest.approx([x for _, x in w.top], abs=1e-4)


def test_regex_choice_and_mixed_batch_keeps_free_rows(tiny_llama):
    """Unconstrained rows, sampled and greedy, both with logprobs, get the same tokens and
    logprobs beside constrained rows (a masked batch samples every row through the sampling
    kernels, greedy ones too, with the all-ones mask) as alone."""
    free = {
        "free": (_params(None, temperature=1.0, seed=7, max_tokens=24, logprobs=3), False, None),
        "greedy": (_params(None, temperature=0.0, max_tokens=24, logprobs=2), False, None),
    }
    alone = _run(make_engine(tiny_llama), free)
    engine = make_engine(tiny_llama)
    col = _run(
        engine,
        {
            **free,
            "rx": (
                _params(Constraint(kind="regex", text=r"[a-c]{2,5}-[0-9]{3}"), temperature=1.0),
                False,
                None,
            ),
            "ch": (
                _params(Constraint(kind="choice", choices=("red", "green", "blue sky"))),
                False,
                None,
            ),
        },
    )
    assert engine.graphs.masks.steps > 0  # the free rows were in masked steps
    for rid in free:
        assert col.tokens[rid] == alone.tokens[rid] and len(col.tokens[rid]) > 1, rid
        assert all(lp is not None and len(lp.top) > 0 for lp in col.logprobs[rid])
        _same_logprobs(col.logprobs[rid], alone.logprobs[rid])
    assert re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", _text(tiny_llama, col.tokens["rx"]))
    assert _text(tiny_llama, col.tokens["ch"]) in ("red", "green", "blue sky")
    assert_all_free(engine)


def test_max_tokens_cut_ends_with_length(tiny_llama):
    engine = make_engine(tiny_llama)
    c = Constraint(
        kind="json_schema",
        text=json.dumps({"type": "array", "items": {"type": "string"}, "minItems": 50}),
    )
    col = _run(engine, {"cut": (_params(c, max_tokens=10, temperature=1.0, seed=3), False, None)})
    assert col.final["cut"].finish_reason == "length"
    assert len(col.tokens["cut"]) == 10
    assert_all_free(engine)


def test_handed_over_first_token_and_preemption(tiny_llama):
    """With KV (the hand-over's path) and a pool so small that sequences are preempted and
    recomputed: the matcher stays right across both."""
    engine = make_engine(tiny_llama, num_blocks=40, block_size=4, max_batch_size=6)
    cases = schemas(seed=2, count=6)
    for s in cases:  # a long required string: the sequences outgrow the pool
        s["properties"]["pad"] = {"type": "string", "minLength": 24, "maxLength": 30}
        s["required"].append("pad")
    reqs = {}
    for i, s in enumerate(cases):
        c = Constraint(kind="json_schema", text=json.dumps(s))
        m = engine.grammars.compile_now(c)
        first = _first_allowed(m, engine.vocab_size)
        params = _params(c, temperature=1.0, seed=100 + i)
        reqs[f"k{i}"] = (params, True, first)
    col = Collected()

    def go(rid, params, first):
        m = engine.grammars.compile_now(params.constraint)
        inp = DecodeInput(rid, PROMPT, first, params, m)
        from decode_helpers import prefill_into_engine

        engine.admit(inp, prefill_into_engine(engine, PROMPT), col.sink(rid))

    drive(engine, {0: [lambda r=r, p=p, f=f: go(r, p, f) for r, (p, _, f) in reqs.items()]})
    assert engine.scheduler.num_preemptions > 0
    for i, s in enumerate(cases):
        rid = f"k{i}"
        assert col.final[rid].finish_reason == "stop", col.final[rid]
        check_instance(json.loads(_text(tiny_llama, [reqs[rid][2], *col.tokens[rid]])), s)
    assert_all_free(engine)


def _first_allowed(matcher, vocab: int) -> int:
    """The smallest token the constraint allows first (what a prefill worker could sample)."""
    import numpy as np

    from splitserve.engine.grammar_masks import fill_masks, mask_words

    mask = np.empty((1, mask_words(vocab)), dtype=np.int32)
    fill_masks([matcher], mask)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return int(np.flatnonzero(bits)[0])


def test_masked_graph_halves_keep_the_overlap(tiny_llama):
    """With (stand-in) captured graphs, a constrained batch replays the forward half, reads the
    previous step's constrained rows while it runs, then the sampling half, then the free row:
    outputs validate, the free row keeps
    its tokens, and the host never waits for a step it has just launched."""
    from test_graph_runner_cpu import _fake_capture

    free = _params(None, temperature=1.0, seed=11, max_tokens=30)
    alone = make_engine(tiny_llama)
    _fake_capture(alone, (1, 2, 4, 8))
    want = _run(alone, {"free": (free, False, None)}).tokens["free"]
    engine = make_engine(tiny_llama)
    _fake_capture(engine, (1, 2, 4, 8))
    cases = schemas(seed=5, count=3)
    reqs = {"free": (free, False, None)}
    for i, s in enumerate(cases):
        c = Constraint(kind="json_schema", text=json.dumps(s))
        reqs[f"j{i}"] = (_params(c, temperature=1.0, seed=i), False, None)
    g, order = engine.graphs, []
    forward, complete = g.run_forward, engine._complete
    g.run_forward = lambda *a: (order.append("forward"), forward(*a))[1]
    engine._complete = lambda h, *hook: (order.append("read"), complete(h, *hook))[1]
    start, accept, sample = g.masks.start, engine._accept, g.run_sample
    g.masks.start = lambda seqs, beside=None: (order.append("mask fill"), start(seqs, beside))[1]
    g.run_sample = lambda *a: (order.append("sampling"), sample(*a))[1]
    engine._accept = lambda seq, *a: (
        order.append("constrained" if seq.matcher else "unconstrained"),
        accept(seq, *a),
    )[1]
    col = _run(engine, reqs)
    steps = "".join(o[0] for o in order)
    # steady masked steps: the step's forward is enqueued before the previous step is read,
    # the mask fill starts after the constrained rows are read, and the free row is read only
    # after the sampling is enqueued
    assert steps.count("fr") > 5, order
    assert steps.count("cmsu") > 5, order
    assert col.tokens["free"] == want
    for i, s in enumerate(cases):
        assert col.final[f"j{i}"].finish_reason == "stop"
        check_instance(json.loads(_text(tiny_llama, col.tokens[f"j{i}"])), s)
    assert engine.sync_reads == 0 and g.masks.steps > 5 and g.num_replays > 5
    assert_all_free(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("beside_min_rows", [1, 10**9])
def test_captured_masked_graphs_on_the_gpu(tiny_llama, beside_min_rows):
    """Real CUDA graphs (the MASK variants' forward and sampling halves): constrained rows
    validate, the free row keeps its tokens, graphs were replayed, the host never waited;
    with the previous step's rows read beside the mask fill (engine/side_thread.py) or not."""
    from splitserve.decode_worker.engine import DecodeEngine

    def cuda_engine() -> DecodeEngine:
        cfg = engine_config(tiny_llama, num_blocks=512, max_batch_size=8)
        # fp32: the free row's logits do not depend on the batch (bf16's may, in a last bit)
        eng = cfg.engine.model_copy(update={"device": "cuda", "dtype": "float32"})
        cfg = cfg.model_copy(update={"engine": eng})
        engine = DecodeEngine(cfg, tokenizer=Tokenizer.from_dir(tiny_llama))
        assert engine.warm_up()
        return engine

    free = _params(None, temperature=1.0, seed=11, max_tokens=30)
    want = _run(cuda_engine(), {"free": (free, False, None)}).tokens["free"]
    engine = cuda_engine()
    engine.beside_min_rows = beside_min_rows
    cases = schemas(seed=9, count=5)
    reqs = {"free": (free, False, None)}
    for i, s in enumerate(cases):
        c = Constraint(kind="json_schema", text=json.dumps(s))
        reqs[f"j{i}"] = (_params(c, temperature=1.0, seed=i), False, None)
    col = _run(engine, reqs)
    assert col.tokens["free"] == want
    for i, s in enumerate(cases):
        assert col.final[f"j{i}"].finish_reason == "stop"
        check_instance(json.loads(_text(tiny_llama, col.tokens[f"j{i}"])), s)
    g = engine.graphs
    assert g.masks.steps > 5 and g.num_replays > 5 and engine.sync_reads == 0
    assert (g.masks.side.jobs_run > 5) == (beside_min_rows == 1)
    assert_all_free(engine)
