"""A masked step reads the previous step's rows on a helper thread while the masks fill
(step_reads.py `_complete`, engine/side_thread.py): the same tokens as reading them on the engine
thread, and a token the constraint refuses still ends only its own request (CPU, tiny model)."""

from __future__ import annotations

import json
import re
import threading

import pytest
from decode_helpers import Collected, assert_all_free, drive, make_engine
from structured_schemas import check_instance, schemas

from splitserve.decode_worker.sequence import DecodeInput
from splitserve.request.constraint import Constraint
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.tokenizer import Tokenizer

PROMPT = [5, 17, 33, 9, 2, 41]
REGEX = r"[a-c]{2,5}-[0-9]{3}"
INLINE = 10**9  # beside_min_rows no batch reaches: every row read on the engine thread


def _requests(engine) -> dict[str, SamplingParams]:
    reqs = {
        "free": SamplingParams(temperature=1.0, seed=7, max_tokens=24, logprobs=2),
        "greedy": SamplingParams(temperature=0.0, max_tokens=24),
        "rx": SamplingParams(
            temperature=1.0, seed=3, constraint=Constraint(kind="regex", text=REGEX)
        ),
    }
    for i, s in enumerate(schemas(seed=9, count=3)):
        c = Constraint(kind="json_schema", text=json.dumps(s))
        reqs[f"j{i}"] = SamplingParams(temperature=1.0, seed=20 + i, max_tokens=120, constraint=c)
    return reqs


def _run(engine, reqs: dict[str, SamplingParams]) -> Collected:
    col = Collected()

    def go(rid: str, p: SamplingParams) -> None:
        m = None if p.constraint is None else engine.grammars.compile_now(p.constraint)
        engine.submit(DecodeInput(rid, PROMPT, None, p, m), col.sink(rid))

    drive(engine, {0: [lambda r=r, p=p: go(r, p) for r, p in reqs.items()]})
    return col


def _accept_threads(engine) -> set[str]:
    names: set[str] = set()
    accept = engine._accept

    def spy(seq, *a):
        names.add(threading.current_thread().name)
        return accept(seq, *a)

    engine._accept = spy
    return names


def test_rows_read_beside_the_fill_give_the_inline_tokens(tiny_llama):
    inline = make_engine(tiny_llama)
    inline.beside_min_rows = INLINE
    want = _run(inline, _requests(inline))
    engine = make_engine(tiny_llama)
    engine.beside_min_rows = 1
    threads = _accept_threads(engine)
    got = _run(engine, _requests(engine))
    assert "mask-side" in threads  # rows were accepted on the helper ...
    assert engine.graphs.masks.side.jobs_run > 5  # ... in most masked steps
    assert inline.graphs.masks.side.jobs_run == 0
    for rid in want.final:
        assert got.tokens[rid] == want.tokens[rid], rid
        assert got.final[rid].finish_reason == want.final[rid].finish_reason, rid
    assert [lp.token_id for lp in got.logprobs["free"]] == got.tokens["free"]
    text = Tokenizer.from_dir(tiny_llama).decode
    assert re.fullmatch(REGEX, text(got.tokens["rx"]))
    for i, s in enumerate(schemas(seed=9, count=3)):
        check_instance(json.loads(text(got.tokens[f"j{i}"])), s)
    assert_all_free(inline)
    assert_all_free(engine)


@pytest.mark.parametrize("beside_min_rows", [1, INLINE])
def test_a_refused_token_ends_only_its_request(tiny_llama, beside_min_rows, caplog):
    """The device sampled under the mask, so a refusal means a broken engine or grammar: the
    request ends with an error, the others go on, every block comes back."""
    alone = make_engine(tiny_llama)
    want = _run(alone, {"free": _requests(alone)["free"]})
    engine = make_engine(tiny_llama)
    engine.beside_min_rows = beside_min_rows
    bad = Tokenizer.from_dir(tiny_llama).encode("z", add_special_tokens=False)[0]
    read, reads = engine.graphs.read, [0]

    def corrupt(handle):
        tokens, lps = read(handle)
        rows = [i for i, s in enumerate(handle.seqs) if s.request_id == "rx"]
        reads[0] += 1
        if rows and reads[0] == 3:  # the regex row's third token: one it cannot take
            tokens[rows[0]] = bad
        return tokens, lps

    engine.graphs.read = corrupt
    reqs = _requests(engine)
    col = _run(engine, {"free": reqs["free"], "rx": reqs["rx"], "j0": reqs["j0"]})
    out = col.final["rx"]
    assert out.finish_reason == "error" and "the constraint failed" in str(out.error)
    assert col.tokens["free"] == want.tokens["free"]
    assert col.final["j0"].finish_reason == "stop"
    assert bad not in col.tokens["rx"]  # the refused token was never streamed
    # nothing was streamed after a final chunk (Collected asserts it; _emit would only log it)
    assert not [r for r in caplog.records if "output sink of" in r.getMessage()]
    assert (engine.graphs.masks.side.jobs_run > 0) == (beside_min_rows == 1)
    assert_all_free(engine)


def test_batches_without_a_constrained_row_leave_the_masked_graphs(tiny_llama):
    """Once the constrained rows have finished, the batch launches the plain variants again
    (one graph, full overlap): MASK only while a constrained row is in the batch."""
    from splitserve.decode_worker.graph_runner import MASK

    engine = make_engine(tiny_llama)
    steps: list[tuple[bool, bool]] = []  # (a constrained row in the batch, MASK launched)
    launch = engine.graphs.launch

    def spy(seqs, *a):
        handle = launch(seqs, *a)
        steps.append((any(s.matcher is not None for s in seqs), bool(handle.variant & MASK)))
        return handle

    engine.graphs.launch = spy
    reqs = _requests(engine)
    short = SamplingParams(temperature=0.0, constraint=Constraint(kind="choice", choices=("ok",)))
    _run(engine, {"free": reqs["free"], "ch": short})
    assert all(constrained == masked for constrained, masked in steps), steps
    first_plain = next(i for i, (c, _) in enumerate(steps) if not c)
    assert steps[0] == (True, True) and first_plain > 0  # masked first, plain after
    assert all(not m for _, m in steps[first_plain:])
    assert_all_free(engine)


def test_a_handed_over_first_token_the_constraint_refuses_is_invalid_argument(tiny_llama):
    """The decode worker rebuilds the matcher from the carried constraint and feeds it the
    prefill worker's first token; a token it refuses ends the admission with INVALID_ARGUMENT
    and the pulled blocks go back."""
    import grpc

    from splitserve.request.errors import RequestError

    engine = make_engine(tiny_llama)
    p = _requests(engine)["rx"]
    bad = Tokenizer.from_dir(tiny_llama).encode("z", add_special_tokens=False)[0]
    blocks = engine.reserve_blocks(2)
    inp = DecodeInput("h", PROMPT, bad, p, engine.grammars.compile_now(p.constraint))
    with pytest.raises(RequestError) as err:
        engine.admit(inp, blocks, Collected().sink("h"))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "not allowed by the request's constraint" in str(err.value)
    assert engine.reserved_blocks == 0
    assert_all_free(engine)
