"""Structured-output pieces without processes: the constraint's bounds and proto conversion, the
worker's grammar cache (compile once, copies, errors), the device mask against a plain
reference, the host masks, and the chat template receiving the tools."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest
import torch

from splitserve.engine.grammar_masks import fill_masks, mask_words
from splitserve.kernels.token_bitmask import apply_token_bitmask_
from splitserve.protos import generate_pb2
from splitserve.request.constraint import LIMITS, MAX_CHOICES, MAX_CONSTRAINT_BYTES, Constraint
from splitserve.request.errors import RequestError
from splitserve.request.grammar_cache import GrammarCache
from splitserve.service.proto_convert import check_sampling_constraint, sampling_params_from_proto


def _convert(**fields):
    sp = generate_pb2.SamplingParams(max_tokens=8, **fields)
    return sampling_params_from_proto(sp, prompt_len=3, max_model_len=64, vocab_size=512)


def _refused(match: str, **fields) -> None:
    with pytest.raises(RequestError) as info:
        check_sampling_constraint(_convert(**fields))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert match in info.value.message, info.value.message


def test_proto_oneof_becomes_one_bounded_constraint():
    assert _convert().constraint is None and _convert(json_object=False).constraint is None
    c = _convert(json_schema='{"type": "integer"}', json_whitespace=2).constraint
    assert (c.kind, c.text, c.json_whitespace) == ("json_schema", '{"type": "integer"}', 2)
    c = _convert(choice=generate_pb2.ChoiceConstraint(choices=["a", "b"])).constraint
    assert (c.kind, c.choices) == ("choice", ("a", "b"))
    assert _convert(regex="x+").constraint.kind == "regex"
    assert _convert(json_object=True).constraint.kind == "json_object"
    # the last oneof member set wins on the wire, as protobuf defines
    sp = generate_pb2.SamplingParams(regex="x", grammar="start: /y/")
    assert sp.WhichOneof("constraint") == "grammar"


def test_bad_constraints_are_invalid_argument_naming_the_field():
    _refused("sampling.regex", regex="a(")
    _refused("unclosed group", regex="a(")
    _refused("sampling.json_schema", json_schema="[1, 2")
    _refused("must be a JSON object", json_schema="[1, 2]")
    _refused("sampling.grammar", grammar="start: missing_rule")
    _refused("empty", regex="")
    _refused("json_whitespace", json_object=True, json_whitespace=5)
    _refused("json_whitespace", regex="a", json_whitespace=1)
    _refused("json_whitespace", json_whitespace=1)
    _refused("min_tokens", regex="a", min_tokens=1)
    _refused("ignore_eos", regex="a", ignore_eos=True)
    _refused("bytes", regex="a" * (MAX_CONSTRAINT_BYTES + 1))
    _refused("choice", choice=generate_pb2.ChoiceConstraint(choices=[]))
    _refused("choice", choice=generate_pb2.ChoiceConstraint(choices=["x"] * (MAX_CHOICES + 1)))
    _refused("choice[1]", choice=generate_pb2.ChoiceConstraint(choices=["x", ""]))


def test_grammar_cache_compiles_once_and_hands_out_copies(tiny_llama):
    cache = GrammarCache(tiny_llama, 512, [2], capacity=2)
    tok = cache.tokenizer()
    c = Constraint(kind="choice", choices=("yes", "no"))
    a, b = cache.compile_now(c), cache.compile_now(c)
    assert cache.compiles == 1 and a is not b
    assert a.consume_tokens(tok.tokenize_str("yes")) and a.is_accepting()
    assert not b.is_accepting()  # b is its own copy, still at the start
    for i in range(3):  # capacity 2: the least recently used goes
        cache.compile_now(Constraint(kind="regex", text=f"a{{{i + 1}}}"))
    cache.compile_now(c)
    assert cache.compiles == 5
    with pytest.raises(RequestError) as info:
        asyncio.run(cache.matcher(Constraint(kind="grammar", text="start: nope")))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown name" in info.value.message
    assert asyncio.run(cache.matcher(None)) is None


def test_grammar_cache_keeps_independent_compiles_up_to_its_lineages(tiny_llama):
    """Copies of one compile fill their masks one at a time (a shared lexer lock), so the cache
    compiles a grammar `lineages` times before it hands out copies, then rotates over them."""
    cache = GrammarCache(tiny_llama, 512, [2], lineages=3)
    tok = cache.tokenizer()
    c = Constraint(kind="choice", choices=("yes", "no"))
    got = [cache.compile_now(c) for _ in range(7)]
    assert cache.compiles == 1 and cache.lineage_compiles == 2 and cache.compiled_count(c) == 3
    assert got[0].consume_tokens(tok.tokenize_str("yes")) and got[0].is_accepting()
    assert not any(m.is_accepting() for m in got[1:])  # each request its own matcher
    cache.compile_now(Constraint(kind="regex", text="a+"))
    assert cache.compiles == 2 and cache.lineage_compiles == 2


def _many_optional_fields(n: int) -> Constraint:
    """A schema of n optional fields: llguidance's compile grows with n squared (~1 s at 2800
    fields on a CI core), under the 64 KiB bound."""
    props = {str(i): {"type": "null"} for i in range(n)}
    return Constraint(
        kind="json_schema",
        text=json.dumps({"type": "object", "properties": props}, separators=(",", ":")),
    )


def test_grammar_limits_and_compile_timeout_are_invalid_argument_naming_them(
    tiny_llama, monkeypatch
):
    """A constraint over one of the grammar engine's LIMITS (lowered here, so that a small
    schema crosses it) is refused by the router's check and by the worker's compile, each
    naming the limit; a compile over the worker's time limit is refused naming that; the cache
    keeps serving either way."""
    schema = json.dumps(
        {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(20)}}
    )
    c = Constraint(kind="json_schema", text=schema)
    cache = GrammarCache(tiny_llama, 512, [2], compile_timeout_s=0.1)
    for limit, says in (
        (
            "max_grammar_size",
            "grammar size (number of symbols) too big (limit for this grammar: 40)",
        ),
        ("initial_lexer_fuel", "initial lexer configuration (grammar) too big"),
    ):
        monkeypatch.setitem(LIMITS, limit, 40)
        _refused(says, json_schema=schema)  # the router's check, without a tokenizer
        with pytest.raises(RequestError) as info:  # the worker's compile
            asyncio.run(cache.matcher(c))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.json_schema" in info.value.message and says in info.value.message
        monkeypatch.undo()
    assert asyncio.run(cache.matcher(c)) is not None and cache.compiles == 1
    # too slow: a real compile of ~1 s against the 0.1 s limit
    slow = _many_optional_fields(2800)
    assert len(slow.text.encode()) <= MAX_CONSTRAINT_BYTES
    with pytest.raises(RequestError) as info:
        asyncio.run(cache.matcher(slow))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "compiling it took over 0.1 s" in info.value.message, info.value.message
    assert asyncio.run(cache.matcher(Constraint(kind="regex", text="ab+"))) is not None
    # nesting past the JSON parser: the engine's bound, not a RecursionError
    _refused("nests too deeply", json_schema="[" * 20_000 + "]" * 20_000)


def test_whitespace_bound(tiny_llama):
    cache = GrammarCache(tiny_llama, 512, [2])
    tok = cache.tokenizer()
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    spaced = tok.tokenize_str('{ "a": 1}')
    tight = cache.compile_now(Constraint(kind="json_schema", text=schema))
    loose = cache.compile_now(Constraint(kind="json_schema", text=schema, json_whitespace=2))
    assert tight.try_consume_tokens(spaced) < len(spaced)
    assert loose.try_consume_tokens(spaced) == len(spaced)


def test_device_mask_matches_the_bits():
    rng = np.random.default_rng(0)
    vocab = 100
    words = rng.integers(-(2**31), 2**31, size=(3, mask_words(vocab)), dtype=np.int64)
    bitmask = torch.from_numpy(words.astype(np.int32))
    logits = torch.randn(3, vocab)
    want = logits.clone()
    bits = np.unpackbits(words.astype(np.int32).view(np.uint8), axis=1, bitorder="little")
    want[torch.from_numpy(bits[:, :vocab] == 0)] = float("-inf")
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, want)


def test_host_masks_allow_only_the_constraint(tiny_llama):
    cache = GrammarCache(tiny_llama, 512, [2])
    tok = cache.tokenizer()
    m = cache.compile_now(Constraint(kind="choice", choices=("yes",)))
    out = np.zeros((2, mask_words(512)), dtype=np.int32)
    fill_masks([None, m], out)
    assert (out[0] == -1).all()
    allowed = np.flatnonzero(np.unpackbits(out[1].view(np.uint8), bitorder="little"))
    assert tok.tokenize_str("yes")[0] in allowed and len(allowed) < 10
    assert m.consume_tokens(tok.tokenize_str("yes"))
    fill_masks([m], out)  # complete: only EOS
    assert list(np.flatnonzero(np.unpackbits(out[0].view(np.uint8), bitorder="little"))) == [2]


def test_chat_template_receives_the_tools(tiny_llama):
    from splitserve.request.tokenizer import Tokenizer
    from splitserve.router.chat_template import render_chat

    tok = Tokenizer.from_dir(tiny_llama)
    tok.chat_template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    assert render_chat(tok, [{"role": "user", "content": "hi"}], "m", [tool]) == "[get_weather]hi"
    assert render_chat(tok, [{"role": "user", "content": "hi"}], "m") == "hi"


def test_tool_turns_reach_the_template_with_object_arguments():
    from splitserve.router.openai_protocol import ChatMessage

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    msg = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]})
    got = msg.as_template_input()
    assert got["content"] is None and got["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    tool = ChatMessage.model_validate({"role": "tool", "tool_call_id": "c1", "content": "ok"})
    assert tool.as_template_input() == {"role": "tool", "content": "ok", "tool_call_id": "c1"}


def test_cli_flags_set_the_constraint(tmp_path):
    import argparse

    from splitserve.cli.client import add_sampling_arguments, sampling_from_args

    p = argparse.ArgumentParser()
    add_sampling_arguments(p)
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "integer"}')
    sp = sampling_from_args(p.parse_args(["--json-schema", f"@{schema}"]))
    assert sp.WhichOneof("constraint") == "json_schema" and sp.json_schema == schema.read_text()
    sp = sampling_from_args(p.parse_args(["--choice", "a", "--choice", "b c"]))
    assert list(sp.choice.choices) == ["a", "b c"]
    assert sampling_from_args(p.parse_args(["--regex", "x+"])).regex == "x+"
    assert sampling_from_args(p.parse_args(["--json-object"])).json_object
    assert sampling_from_args(p.parse_args([])).WhichOneof("constraint") is None
    with pytest.raises(SystemExit):
        p.parse_args(["--regex", "x", "--json-object"])


@pytest.mark.parametrize("choice", [None, "auto"])
def test_tool_choice_auto_says_what_to_send_instead(choice):
    """No free-form tool-call parser: "auto" (and no tool_choice with tools) is a 400 that names
    the three choices that work."""
    from splitserve.router.openai_errors import OpenAIError
    from splitserve.router.openai_structured import tool_constraint

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(OpenAIError) as err:
        tool_constraint(tools, choice, generate_pb2.SamplingParams())
    e = err.value
    assert e.status == 400 and e.param == "tool_choice"
    for fix in ('"required"', "name a function", '"none"'):
        assert fix in e.message, e.message
    assert tool_constraint(tools, "none", generate_pb2.SamplingParams()) is None
