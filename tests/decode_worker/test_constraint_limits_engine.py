"""A constraint that hits the grammar engine's limits mid-generation, in the decode engine (CPU,
tiny model): the row ends alone with INVALID_ARGUMENT naming the output token (never a clean
"stop" on the EOS-only mask llguidance gives a broken matcher, never INTERNAL), its blocks are
freed, its grammar's broken compiles are dropped, and the other rows keep their tokens and the
number of steps they take. Handed-over and colocated first tokens; a consume that fails and a
mask fill that fails (a lexer broken by another copy of the same compile)."""

from __future__ import annotations

import re

import grpc
from decode_helpers import Collected, assert_all_free, drive, make_engine, prefill_into_engine

from splitserve.decode_worker.sequence import DecodeInput
from splitserve.request.constraint import Constraint, is_limit_error, lowest_allowed
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.tokenizer import Tokenizer

PROMPT = [5, 17, 33, 9, 2, 41]
EOS = 2
# healthy at token 0 (the compile's probe follows "x"); past the lexer's fuel once "y" is taken
LATE = Constraint(kind="regex", text="x+|y(a{1000}){1000}")
RX = r"[a-c]{2,5}-[0-9]{3}"
FREE = SamplingParams(temperature=1.0, seed=7, max_tokens=30)
HEALTHY = SamplingParams(
    temperature=1.0, seed=3, max_tokens=20, constraint=Constraint(kind="regex", text=RX)
)
LATE_ROW = SamplingParams(temperature=1.0, seed=5, max_tokens=20, constraint=LATE)


def _token(engine, text: str) -> int:
    [tok] = engine.grammars.tokenizer().tokenize_str(text)
    return tok


def _colocated(engine, col, rid, params, matcher=None):
    if matcher is None and params.constraint is not None:
        matcher = engine.grammars.compile_now(params.constraint)
    engine.submit(DecodeInput(rid, PROMPT, None, params, matcher), col.sink(rid))


def _handed_over(engine, col, rid, first, params, matcher=None):
    matcher = matcher or engine.grammars.compile_now(params.constraint)
    inp = DecodeInput(rid, PROMPT, first, params, matcher)
    engine.admit(inp, prefill_into_engine(engine, PROMPT), col.sink(rid))


def _break_lexer(engine, c: Constraint) -> None:
    """What another request's row of `c` does: a copy of the cached compile (sharing its lexer)
    walks into the blown state, which breaks the lexer for every copy."""
    walker = engine.grammars.compile_now(c)
    assert walker.consume_token(_token(engine, "y"))
    bits = walker.compute_bitmask()
    if not walker.is_error():
        walker.consume_token(lowest_allowed(bits, [EOS]))
    assert is_limit_error(walker.get_error())


def _drive_beside_others(engine, col: Collected, *more) -> int:
    """Submits the free and the healthy constrained row at step 0, then `more` (callables, in
    order, the same step), and drives `engine` until all have ended; the steps taken."""
    return drive(
        engine,
        {
            0: [
                lambda: _colocated(engine, col, "free", FREE),
                lambda: _colocated(engine, col, "rx", HEALTHY),
                *more,
            ]
        },
    )


def _baseline(model) -> tuple[Collected, int]:
    """The free and the healthy constrained row alone: their tokens and the steps taken."""
    engine = make_engine(model)
    col = Collected()
    steps = _drive_beside_others(engine, col)
    assert_all_free(engine)
    return col, steps


def _assert_others_kept(model, col: Collected, steps: int) -> None:
    want, want_steps = _baseline(model)
    assert col.tokens["free"] == want.tokens["free"] and len(col.tokens["free"]) == 30
    assert col.tokens["rx"] == want.tokens["rx"]
    assert re.fullmatch(RX, Tokenizer.from_dir(model).decode(col.tokens["rx"]))
    assert steps == want_steps  # their pace, in steps: the failing rows cost none


def _assert_over_limits(col: Collected, rid: str, token: int) -> None:
    out = col.final[rid]
    assert out.finish_reason == "error", (rid, out)
    assert out.error.code == grpc.StatusCode.INVALID_ARGUMENT, out.error
    msg = out.error.message
    assert f"exceeded the grammar engine's limits at output token {token}:" in msg, msg
    assert "too many expressions constructed" in msg, msg


def test_handed_over_row_past_the_limits_ends_alone_with_invalid_argument(tiny_llama):
    """The prefill worker sampled "y" (healthy so far); the decode worker's next mask or consume
    runs out of lexer fuel: that row ends at output token 2, the grammar's compile is dropped."""
    engine = make_engine(tiny_llama)
    col = Collected()
    steps = _drive_beside_others(
        engine, col, lambda: _handed_over(engine, col, "late", _token(engine, "y"), LATE_ROW)
    )
    _assert_over_limits(col, "late", 2)
    assert col.tokens["late"] == []  # the token sampled under the broken state never streams
    assert engine.grammars.compiled_count(LATE) == 0
    assert_all_free(engine)
    _assert_others_kept(tiny_llama, col, steps)


def test_a_row_whose_mask_fill_fails_ends_before_its_eos_passes_for_a_stop(tiny_llama):
    """Two rows share one compile (lineages 1). Row "x" is admitted on "x", then another copy
    breaks the shared lexer: the next fill gives row "x" an EOS-only mask, which its matcher
    would consume as a clean end; it ends with INVALID_ARGUMENT at output token 2 instead."""
    engine = make_engine(tiny_llama)
    engine.grammars.lineages = 1
    col = Collected()

    def admit_then_break():
        _handed_over(engine, col, "x", _token(engine, "x"), LATE_ROW)
        _break_lexer(engine, LATE)

    steps = _drive_beside_others(engine, col, admit_then_break)
    _assert_over_limits(col, "x", 2)
    assert col.tokens["x"] == []
    assert engine.grammars.compiled_count(LATE) == 0
    assert_all_free(engine)
    _assert_others_kept(tiny_llama, col, steps)
    # the next request of the grammar compiles afresh, and runs
    col2 = Collected()
    drive(engine, {0: [lambda: _handed_over(engine, col2, "again", _token(engine, "x"), LATE_ROW)]})
    assert col2.final["again"].finish_reason in ("stop", "length"), col2.final["again"]
    text = Tokenizer.from_dir(tiny_llama).decode([t for t in col2.tokens["again"] if t != EOS])
    assert re.fullmatch("x*", text), text  # "x" + this: the grammar's x+ branch
    assert_all_free(engine)


def test_colocated_first_token_of_a_broken_lexer_is_invalid_argument(tiny_llama):
    """Colocated: the decode worker samples token 0 itself (host masks). A copy of a compile
    whose lexer broke gets the EOS-only mask there: INVALID_ARGUMENT at output token 1, not a
    one-token "stop"."""
    engine = make_engine(tiny_llama)
    engine.grammars.lineages = 1
    col = Collected()
    matcher = engine.grammars.compile_now(LATE)
    _break_lexer(engine, LATE)
    steps = _drive_beside_others(
        engine, col, lambda: _colocated(engine, col, "late", LATE_ROW, matcher)
    )
    _assert_over_limits(col, "late", 1)
    assert col.tokens["late"] == []
    assert_all_free(engine)
    _assert_others_kept(tiny_llama, col, steps)
