"""Structured-output options end to end (the session's real router + prefill + decode workers,
tiny model with random weights): a json_schema without `strict` is enforced all the same, the
JSON whitespace bound reaches the grammar through the OpenAI API, and a json_object output
holds its constraint token by token even when max_tokens cuts it."""

from __future__ import annotations

import json
import re

import openai
import pytest
from openai_helpers import MODEL, chat_until_stop
from structured_schemas import MAX_TOKENS, check_instance, schemas

from splitserve.protos import generate_pb2
from splitserve.request.constraint import Constraint
from splitserve.request.grammar_cache import GrammarCache

MSGS = [{"role": "user", "content": "A list as JSON."}]


def test_json_schema_without_strict_is_enforced(stack, client):
    for i, schema in enumerate(schemas(seed=40, count=3)):
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
        if i == 1:
            fmt["json_schema"]["strict"] = False
        text = chat_until_stop(client, MSGS, i, MAX_TOKENS, response_format=fmt)
        check_instance(json.loads(text), schema)
    stack.assert_free()


def test_json_whitespace_bound_through_the_openai_api(stack, client):
    """structured_outputs.json_whitespace beside response_format (or with structured_outputs'
    own json): blanks appear between JSON tokens, never more than the bound, and the output
    still parses; out of range, or beside a non-JSON constraint, it is a 400 naming it."""
    schema = {"type": "array", "items": {"enum": [1, 22, 333]}, "minItems": 2, "maxItems": 5}
    blanks = 0
    for seed in range(8):
        extra = {"structured_outputs": {"json_whitespace": 2}}
        kw = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": schema},
            }
        }
        if seed % 2:
            extra["structured_outputs"]["json"] = schema
            kw = {}
        text = chat_until_stop(client, MSGS, seed, MAX_TOKENS, extra_body=extra, **kw)
        check_instance(json.loads(text), schema)
        assert not re.search(r"\s{3,}", text), text
        blanks += len(re.findall(r"\s", text))
    assert blanks > 0  # the bound allowed blanks and the sampling took some
    for so, why in (
        ({"json_object": True, "json_whitespace": 9}, "json_whitespace"),
        ({"regex": "a+", "json_whitespace": 1}, "JSON"),
        ({"json_whitespace": 1}, "JSON"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL,
                messages=MSGS,
                max_completion_tokens=4,
                extra_body={"structured_outputs": so},
            )
        body = info.value.body
        assert body["param"].startswith("structured_outputs") and why in body["message"], body
    stack.assert_free()


def test_json_object_holds_token_by_token(stack):
    """Any JSON object, sampled: each output's tokens are all accepted, in order, by a fresh
    matcher of the same grammar; one that stopped parses as an object."""
    cache = GrammarCache(stack.model, *_vocab_and_eos(stack.model))
    ended = 0
    for seed in range(6):
        sp = generate_pb2.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, json_object=True
        )
        chunks = stack.grpc_generate("JSON:", sp)
        ids = [t for c in chunks for t in c.token_ids]
        matcher = cache.compile_now(Constraint(kind="json_object"))
        assert matcher.consume_tokens(ids), (seed, matcher.get_error())
        if chunks[-1].finish_reason == generate_pb2.FINISH_REASON_STOP:
            ended += 1
            assert isinstance(json.loads("".join(c.text for c in chunks)), dict)
        else:
            assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
            assert len(ids) == MAX_TOKENS
    assert ended > 0  # 3 of these 6 seeds close the object with the embedded tiny model
    stack.assert_free()


def _vocab_and_eos(model) -> tuple[int, list[int]]:
    cfg = json.loads((model / "config.json").read_text())
    eos = cfg["eos_token_id"]
    return cfg["vocab_size"], eos if isinstance(eos, list) else [eos]
