"""Constraints the grammar engine cannot handle, without processes: the router's check and the
worker's compile refuse what blows llguidance's limits at its start (its lexer is built lazily:
a regex like `(a{1000}){1000}` compiles, then fails its first tokens), the probe leaves
healthy grammars at token 0, limit errors are told from refused tokens, a compile whose lexer
broke is dropped, and a failed fill is reported for the engine to end the row."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest
from structured_schemas import schemas

from splitserve.engine.grammar_masks import fill_masks, mask_words
from splitserve.protos import generate_pb2
from splitserve.request.constraint import (
    LIMITS,
    Constraint,
    engine_message,
    is_limit_error,
    limits_exceeded,
    lowest_allowed,
    probe,
)
from splitserve.request.errors import RequestError
from splitserve.request.grammar_cache import GrammarCache
from splitserve.service.proto_convert import check_sampling_constraint, sampling_params_from_proto

BLOWN = "(a{1000}){1000}"  # the audit's: 10^6 forced bytes, past the lexer's fuel
# each way in: a regex, a JSON schema's pattern, a Lark grammar's terminal
EXCEEDING = {
    "regex": BLOWN,
    "json_schema": json.dumps({"type": "string", "pattern": f"^{BLOWN}$"}),
    "grammar": f"start: /{BLOWN}/",
}
# fine at token 0 (the probe follows "x"), past the limits once "y" is taken
LATE = "x+|y(a{1000}){1000}"


def _sampling(kind: str, text: str) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(max_tokens=8, **{kind: text})


def _router_check(sp: generate_pb2.SamplingParams) -> None:
    check_sampling_constraint(
        sampling_params_from_proto(sp, prompt_len=3, max_model_len=64, vocab_size=512)
    )


@pytest.mark.parametrize("kind", sorted(EXCEEDING))
def test_router_check_refuses_a_constraint_past_the_limits_with_the_engines_message(kind):
    with pytest.raises(RequestError) as info:
        _router_check(_sampling(kind, EXCEEDING[kind]))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    msg = info.value.message
    assert f"sampling.{kind}" in msg and "exceeds the grammar engine's limits" in msg, msg
    assert "too many expressions constructed" in msg and "<non-verbose/>" not in msg, msg


def test_router_check_remembers_its_verdict_and_passes_healthy_constraints():
    """A verdict is kept per grammar text (and limits): the schema every request repeats is
    compiled once; healthy constraints, near misses included, pass."""
    from splitserve.request import constraint

    for kind, text in (
        ("regex", "(a{100}){100}"),
        ("regex", LATE),
        ("regex", r"[a-c]{2,5}-[0-9]{3}"),
        ("json_schema", json.dumps(schemas(seed=3, count=1)[0])),
        ("grammar", 'start: "yes" | "no"'),
    ):
        _router_check(_sampling(kind, text))
    before = len(constraint._VERDICTS)
    for _ in range(3):
        with pytest.raises(RequestError):
            _router_check(_sampling("regex", BLOWN))
        _router_check(_sampling("regex", LATE))
    assert len(constraint._VERDICTS) <= before + 1  # BLOWN's at most: LATE's was kept


@pytest.mark.parametrize("kind", sorted(EXCEEDING))
def test_worker_compile_refuses_it_before_anything_is_cached(tiny_llama, kind):
    cache = GrammarCache(tiny_llama, 512, [2])
    c = Constraint(kind=kind, text=EXCEEDING[kind])
    with pytest.raises(RequestError) as info:
        asyncio.run(cache.matcher(c))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the grammar engine's limits" in info.value.message, info.value.message
    assert "too many expressions constructed" in info.value.message
    assert cache.compiled_count(c) == 0 and cache.compiles == 0
    assert asyncio.run(cache.matcher(Constraint(kind="regex", text="(a{100}){100}"))) is not None


def test_probe_leaves_the_matcher_at_token_zero_and_spends_the_compile_fuel(tiny_llama):
    """The probe walks a copy: the matcher handed out is still at its start, and a later copy's
    walk to the blown state fails on the step's fuel, not the compile's (its lexer was built)."""
    cache = GrammarCache(tiny_llama, 512, [2], lineages=1)
    tok = cache.tokenizer()
    m = cache.compile_now(Constraint(kind="regex", text=LATE))
    x, y = tok.tokenize_str("x")[0], tok.tokenize_str("y")[0]
    assert lowest_allowed(m.compute_bitmask(), [2]) == x  # still at token 0
    assert m.consume_token(y)
    bits = m.compute_bitmask()
    if not m.is_error():  # the forced bytes' walk ran dry in the mask: the next token fails
        assert not m.consume_token(lowest_allowed(bits, [2]))
    assert is_limit_error(m.get_error()), m.get_error()
    # an explicit probe of a healthy grammar: '' and nothing consumed
    fresh = cache.compile_now(Constraint(kind="choice", choices=("yes", "no")))
    assert probe(fresh, [2]) == "" and not fresh.is_accepting()


def test_limit_errors_are_told_from_refused_tokens(tiny_llama):
    cache = GrammarCache(tiny_llama, 512, [2])
    tok = cache.tokenizer()
    m = cache.compile_now(Constraint(kind="choice", choices=("yes",)))
    assert not m.consume_token(tok.tokenize_str("no")[0])
    assert not is_limit_error(m.get_error()), m.get_error()  # a refused token: not a limit
    assert is_limit_error("lexer error: too many expressions constructed\n<non-verbose/>")
    assert is_limit_error("parser error: Too many items (limit 10000; mask)")
    assert engine_message("lexer error: x\n<non-verbose/>") == "lexer error: x"
    msg = limits_exceeded(7, "lexer error: too many states: 9 >= 9\n<non-verbose/>")
    assert msg.startswith("the constraint exceeded the grammar engine's limits at output token 7")
    assert "too many states" in msg and "<non-verbose/>" not in msg
    assert lowest_allowed(bytes([0b0000_0100, 0, 0, 0]), []) == 2
    assert lowest_allowed(bytes([0b0000_0100, 0, 0, 0]), [2]) is None


def test_step_limits_stay_below_llguidances_defaults():
    """Per step, a row's lexer work is bounded by the step fuel (twice: the forced-bytes walk
    runs on what the last step left); llguidance's default (200k) let a blown row cost ~45 ms
    on a CI core, 20k about 5."""
    import llguidance

    defaults = llguidance.LLParserLimits()
    assert LIMITS["step_lexer_fuel"] * 5 <= defaults.step_lexer_fuel
    assert LIMITS["step_max_items"] * 5 <= defaults.step_max_items


def _poisoned(cache: GrammarCache, c: Constraint) -> None:
    """Breaks the lexer that every copy of `c`'s compile shares: a copy walks into the blown
    state (what another request's row would do)."""
    tok = cache.tokenizer()
    walker = cache.compile_now(c)
    assert walker.consume_token(tok.tokenize_str("y")[0])
    bits = walker.compute_bitmask()
    if not walker.is_error():
        walker.consume_token(lowest_allowed(bits, [2]))
    assert is_limit_error(walker.get_error())


def test_a_failed_fill_masks_to_eos_only_so_it_must_be_reported(tiny_llama):
    """A copy whose shared lexer broke gets an EOS-only mask from llguidance, and would take
    that EOS as a clean end: TokenMasks reports the row (and a row that copied its mask) for
    the engine to end; the healthy row beside it keeps its own mask."""
    import torch

    from splitserve.decode_worker.token_masks import TokenMasks

    cache = GrammarCache(tiny_llama, 512, [2], lineages=1)
    late = Constraint(kind="regex", text=LATE)
    tok = cache.tokenizer()
    x = tok.tokenize_str("x")[0]
    bad, twin = cache.compile_now(late), cache.compile_now(late)
    healthy = GrammarCache(tiny_llama, 512, [2]).compile_now(late)
    _poisoned(cache, late)
    out = np.zeros((1, mask_words(512)), dtype=np.int32)
    fill_masks([bad], out)
    assert bad.is_error() and bad.consume_token(2)  # EOS only, and "consumed": hence the check

    class Row:  # what TokenMasks reads of a DecodeSequence
        def __init__(self, m, fp):
            self.matcher, self.finished, self.grammar_fp = m, False, fp
            self.output_token_ids, self.params = [x], type("P", (), {"constraint": late})()

    masks = TokenMasks(4, 512, torch.device("cpu"))
    rows = [Row(twin, 1), Row(twin.deep_copy(), 1), Row(healthy, 2), Row(None, 3)]
    masks.start(rows)
    failed = masks.take_failed()
    assert [r for r, _ in failed] == rows[:2], failed
    assert all(is_limit_error(why) for _, why in failed)
    assert masks.take_failed() == [] and not healthy.is_error()
    masks.finish(rows)
    allowed = np.flatnonzero(np.unpackbits(masks.host[2].numpy().view(np.uint8), bitorder="little"))
    assert x in allowed  # the healthy row's own mask
    masks.close()
    cache.discard(late)
    assert cache.compiled_count(late) == 0
