"""The grammar cache's finer llguidance slices (grammar_cache.MASK_SLICES) only change how a
mask is computed, never what it allows: along random walks through schemas with short bounded
strings, every mask equals the one llguidance's default slices give."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest

from splitserve.engine.grammar_masks import fill_masks, mask_words
from splitserve.request.constraint import Constraint, parser_limits
from splitserve.request.grammar_cache import MASK_SLICES, GrammarCache
from splitserve.request.tokenizer import TOKENIZER_FILE

VOCAB = 512


def _schema(max_len: int) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": max_len},
            "note": {"type": "string", "maxLength": max_len + 9},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        },
        "required": ["name", "note", "tags"],
        "additionalProperties": False,
    }


def _bits(matcher) -> np.ndarray:
    mask = np.empty((1, mask_words(VOCAB)), dtype=np.int32)
    fill_masks([matcher], mask)
    return np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB]


@pytest.mark.parametrize("max_len", [1, 4, 8, 11, 25])
def test_finer_slices_allow_exactly_what_the_default_ones_do(tiny_llama, max_len):
    assert llguidance.LLTokenizer.general_slices()[0] in MASK_SLICES
    cache = GrammarCache(tiny_llama, VOCAB, [2])
    c = Constraint(kind="json_schema", text=json.dumps(_schema(max_len)))
    default_tok = llguidance.LLTokenizer(
        (tiny_llama / TOKENIZER_FILE).read_text(), n_vocab=VOCAB, eos_token=2
    )
    rng = np.random.default_rng(max_len)
    for _ in range(3):
        ours = cache.compile_now(c)
        theirs = llguidance.LLMatcher(default_tok, c.grammar(), limits=parser_limits())
        for _ in range(80):
            a, b = _bits(ours), _bits(theirs)
            assert np.array_equal(a, b), np.flatnonzero(a != b)[:10]
            allowed = np.flatnonzero(a)
            allowed = allowed[allowed != 2]
            if len(allowed) == 0:
                break
            tok = int(rng.choice(allowed))
            assert ours.consume_token(tok) and theirs.consume_token(tok)
