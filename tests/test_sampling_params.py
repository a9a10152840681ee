"""SamplingParams: every bad value is refused with the field's name; defaults are vLLM's."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from splitserve.request.sampling_params import SamplingParams, validate_against_vocab

BAD = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("seed", -1),
    ("seed", 2**64),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", -math.inf),
    ("stop", ("ok", "")),
    ("stop", (1,)),
    ("stop_token_ids", (3, -1)),
    ("include_stop_str_in_output", "maybe"),
    ("ignore_eos", "perhaps"),
    ("logprobs", -1),
    ("logprobs", 21),
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_bad_value_names_the_field(name, value):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{name: value})
    errors = info.value.errors()
    assert errors and all(e["loc"][0] == name for e in errors)
    assert name in str(info.value)


def test_unknown_field_refused():
    with pytest.raises(ValidationError, match="temprature"):
        SamplingParams(temprature=0.5)


def test_defaults_and_edges_accepted():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.logprobs is None and p.stop == () and p.stop_token_ids == ()
    assert not p.is_greedy and not p.needs_penalties
    edge = SamplingParams(
        temperature=0.0,
        top_p=1e-9,
        top_k=-1,
        min_p=1.0,
        seed=2**64 - 1,
        repetition_penalty=1e-3,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        logprobs=20,
        stop=["a", "bc"],
        stop_token_ids=[0, 7],
    )
    assert edge.stop == ("a", "bc") and edge.stop_token_ids == (0, 7)  # lists become tuples
    assert SamplingParams(logprobs=0).logprobs == 0


def test_single_stop_string_is_a_tuple():
    assert SamplingParams(stop="###").stop == ("###",)


def test_frozen():
    p = SamplingParams()
    with pytest.raises(ValidationError, match="frozen"):
        p.temperature = 0.5
    assert hash(p) == hash(SamplingParams())


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.01}, False),
        ({"top_k": 2}, False),
        ({"top_k": -1}, False),
    ],
)
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy


@pytest.mark.parametrize(
    ("kwargs", "needs"),
    [
        ({}, False),
        ({"repetition_penalty": 1.1}, True),
        ({"presence_penalty": 0.5}, True),
        ({"frequency_penalty": -0.5}, True),
        ({"temperature": 0.0, "top_k": 5}, False),
    ],
)
def test_needs_penalties(kwargs, needs):
    assert SamplingParams(**kwargs).needs_penalties is needs


def test_validate_against_vocab():
    validate_against_vocab(SamplingParams(stop_token_ids=(0, 99)), 100)
    with pytest.raises(ValueError, match=r"stop_token_ids \[100, 500\].*100"):
        validate_against_vocab(SamplingParams(stop_token_ids=(5, 100, 500)), 100)
