"""engine/grammar_masks.py's MaskFiller: the same masks as llguidance's own parallel fill,
rows taken costliest first, a failing row's error raised after every thread is done."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from splitserve.engine import grammar_masks
from splitserve.engine.grammar_masks import MaskFiller, fill_masks, mask_words
from splitserve.request.constraint import Constraint
from splitserve.request.grammar_cache import GrammarCache

VOCAB, EOS = 512, 2
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2},
    {"type": "object", "properties": {"t": {"enum": ["x", "yy"]}, "n": {"type": "number"}}},
]


class Recorder:
    """A matcher stand-in that logs which row it filled, in order (or fails at once)."""

    def __init__(self, inner, log: list, fail: bool = False, delay: float = 0.0) -> None:
        self.inner, self.log, self.fail, self.delay = inner, log, fail, delay

    def is_error(self) -> bool:
        return False

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        if self.fail:
            self.log.append(self)
            raise RuntimeError("row failed")
        time.sleep(self.delay)  # a slow row: still running when the failing one raises
        self.inner.unsafe_compute_mask_ptr(ptr, nbytes)
        self.log.append(self)


def test_rows_fill_the_same_masks_as_llguidance_par(tiny_llama, monkeypatch):
    cache = GrammarCache(tiny_llama, VOCAB, [EOS], lineages=4)
    matchers = [
        cache.compile_now(Constraint(kind="json_schema", text=json.dumps(SCHEMAS[i % 3])))
        for i in range(12)
    ]
    filler = MaskFiller(threads=3)
    rng = np.random.default_rng(0)
    got = np.empty((12, mask_words(VOCAB)), dtype=np.int32)
    want = np.empty_like(got)
    for _ in range(25):  # a random walk: every row in several lexer states
        monkeypatch.setattr(grammar_masks, "FILL_MODE", "rayon")
        fill_masks(matchers, want)
        monkeypatch.setattr(grammar_masks, "FILL_MODE", "rows")
        got[:] = 0
        fill_masks(matchers, got, filler=filler)
        assert (got == want).all()
        bits = np.unpackbits(got.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
        for m, row in zip(matchers, bits):
            allowed = np.flatnonzero(row)
            allowed = allowed[allowed != EOS]
            if len(allowed) == 0:
                m.reset()
            else:
                assert m.consume_token(int(rng.choice(allowed)))
    assert set(filler._cost) == {id(m) for m in matchers}
    filler.close()


def test_rows_start_with_the_costliest_last_time(tiny_llama):
    cache = GrammarCache(tiny_llama, VOCAB, [EOS])
    c = Constraint(kind="json_schema", text=json.dumps(SCHEMAS[0]))
    log: list = []
    rows = [Recorder(cache.compile_now(c), log) for _ in range(4)]
    filler = MaskFiller(threads=1)  # one thread: the order it takes rows is the list's
    filler._cost = {id(rows[2]): 5.0, id(rows[0]): 1.0, id(rows[3]): 3.0}
    out = np.empty((4, mask_words(VOCAB)), dtype=np.int32)
    filler.fill([(r, i) for i, r in enumerate(rows)], out)
    assert log == [rows[2], rows[3], rows[0], rows[1]]
    assert set(filler._cost) == {id(r) for r in rows}  # measured anew for the next fill


def test_a_failing_row_raises_once_every_thread_is_done(tiny_llama):
    cache = GrammarCache(tiny_llama, VOCAB, [EOS])
    c = Constraint(kind="json_schema", text=json.dumps(SCHEMAS[1]))
    log: list = []
    rows = [Recorder(cache.compile_now(c), log, i == 1, delay=0.05) for i in range(6)]
    filler = MaskFiller(threads=3)
    filler._cost = {id(rows[1]): 1.0}  # the failing row first: the others are still to come
    out = np.empty((6, mask_words(VOCAB)), dtype=np.int32)
    with pytest.raises(RuntimeError, match="row failed"):
        filler.fill([(r, i) for i, r in enumerate(rows)], out)
    assert len(log) == 6  # every slow row was done before fill raised; the filler still serves
    good = [(r, i) for i, r in enumerate(rows) if i != 1]
    filler.fill(good, out)
    with pytest.raises(ValueError, match="C-contiguous int32"):
        filler.fill(good, out[:, ::2])
    with pytest.raises(ValueError, match="outside the 4 mask rows"):
        filler.fill(good, out[:4])  # never a write past the array
    filler.close()
    with pytest.raises(RuntimeError, match="closed"):
        filler.fill(good, out)
