"""Stop rules (vLLM's) and the held-back tail that keeps split stop strings off the stream."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from splitserve.cli.tiny_tokenizer import write_byte_level_tokenizer
from splitserve.request.detokenizer import IncrementalDetokenizer
from splitserve.request.stop_checker import StopChecker
from splitserve.request.tokenizer import Tokenizer

EOS = 2
TEXT_TOKEN = 100  # any id that is neither eos nor a stop token


@dataclass(frozen=True)
class Params:
    max_tokens: int | None = 100
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0


def checker(max_model_len=1000, prompt_len=5, **kw) -> StopChecker:
    return StopChecker(
        Params(**kw), eos_token_ids=(EOS,), max_model_len=max_model_len, prompt_len=prompt_len
    )


def feed(chk: StopChecker, deltas, token_ids=None):
    """Feed text deltas; returns the streamed pieces and the last result."""
    token_ids = token_ids or [TEXT_TOKEN] * len(deltas)
    pieces, result = [], None
    for token_id, delta in zip(token_ids, deltas):
        result = chk.update(token_id, delta)
        pieces.append(result.text)
        if result.finished:
            break
    return pieces, result


def test_stop_string_split_across_tokens_is_never_streamed():
    pieces, result = feed(checker(stop=("</end>",)), ["Hel", "lo </", "en", "d> tail", "more"])
    assert pieces == ["Hel", "lo ", "", ""]
    assert (result.finish_reason, result.stop_reason) == ("stop", "</end>")


def test_include_stop_str_in_output():
    chk = checker(stop=("</end>",), include_stop_str_in_output=True)
    pieces, result = feed(chk, ["Hel", "lo </", "end> tail"])
    assert "".join(pieces) == "Hello </end>"
    assert result.stop_reason == "</end>"


def test_false_alarm_is_released():
    pieces, result = feed(checker(stop=("</end>",)), ["a </", "x> b"])
    assert pieces == ["a ", "</x> b"] and result.finish_reason is None


@pytest.mark.parametrize("finisher", ["length", "eos", "stop_token"])
def test_held_tail_is_flushed_when_finishing_otherwise(finisher):
    chk = checker(stop=("</end>",), max_tokens=2, stop_token_ids=(7,))
    token = {"length": TEXT_TOKEN, "eos": EOS, "stop_token": 7}[finisher]
    delta = "</e" if finisher == "length" else "<tok>"
    pieces, result = feed(chk, ["a </", delta], [TEXT_TOKEN, token])
    expected = "a </</e" if finisher == "length" else "a </"  # the stop token's text is dropped
    assert "".join(pieces) == expected
    assert result.finish_reason == ("length" if finisher == "length" else "stop")
    assert result.stop_reason == (7 if finisher == "stop_token" else None)


@pytest.mark.parametrize("stop", [("world", "lo"), ("lo", "world")])
def test_earliest_stop_string_wins(stop):
    _, result = feed(checker(stop=stop), ["hello world"])
    assert (result.text, result.stop_reason) == ("hel", "lo")


def test_eos_stops_and_its_text_is_dropped():
    pieces, result = feed(checker(), ["Hi", "</s>"], [TEXT_TOKEN, EOS])
    assert pieces == ["Hi", ""] and (result.finish_reason, result.stop_reason) == ("stop", None)
    _, result = feed(checker(include_stop_str_in_output=True), ["</s>"], [EOS])
    assert result.text == "</s>"


def test_ignore_eos_keeps_going():
    chk = checker(ignore_eos=True, max_tokens=3)
    pieces, result = feed(chk, ["a", "", "b"], [TEXT_TOKEN, EOS, TEXT_TOKEN])
    assert pieces == ["a", "", "b"] and result.finish_reason == "length"
    # A listed stop token still stops, even when it is the ignored eos.
    _, result = feed(checker(ignore_eos=True, stop_token_ids=(EOS,)), ["x"], [EOS])
    assert (result.finish_reason, result.stop_reason) == ("stop", EOS)


def test_stop_token_ids():
    pieces, result = feed(
        checker(stop_token_ids=(7, 9)), ["a", "b", "c"], [TEXT_TOKEN, 9, TEXT_TOKEN]
    )
    assert pieces == ["a", ""] and (result.finish_reason, result.stop_reason) == ("stop", 9)


def test_max_tokens():
    chk = checker(max_tokens=3)
    pieces, result = feed(chk, ["a", "b", "c", "d"])
    assert pieces == ["a", "b", "c"] and result.finish_reason == "length" and chk.num_generated == 3
    with pytest.raises(RuntimeError, match="finished"):
        chk.update(TEXT_TOKEN, "x")


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_max_model_len(max_tokens):
    pieces, result = feed(
        checker(max_model_len=8, prompt_len=6, max_tokens=max_tokens), ["a", "b", "c"]
    )
    assert pieces == ["a", "b"] and result.finish_reason == "length"


def test_stop_string_beats_length_on_the_same_token():
    _, result = feed(checker(max_tokens=1, stop=("b",)), ["abc"])
    assert (result.text, result.finish_reason) == ("a", "stop")


@pytest.mark.parametrize("kw", [{"prompt_len": 8, "max_model_len": 8}, {"max_tokens": 0}])
def test_bad_limits_are_refused(kw):
    with pytest.raises(ValueError):
        checker(**kw)


def test_min_tokens_suppresses_eos_stop_ids_and_stop_strings():
    """vLLM: before min_tokens tokens, eos / stop ids / stop strings are ordinary tokens."""
    kw = dict(min_tokens=3, stop_token_ids=(7,), stop=("x",))
    for finisher, reason in ((EOS, None), (7, 7), (TEXT_TOKEN, "x")):
        pieces, result = feed(checker(**kw), ["a", "x", "x", "tail"], [EOS, 7, finisher, 1])
        assert pieces == ["a", "x", ""], finisher  # the earlier eos, 7 and "x" went out as text
        assert (result.finish_reason, result.stop_reason) == ("stop", reason), finisher
    # a stop string may start before min_tokens and end at it; one that ended before never counts
    _, result = feed(checker(min_tokens=2, stop=("ab",)), ["a", "b"])
    assert (result.text, result.stop_reason) == ("", "ab")
    pieces, result = feed(checker(min_tokens=2, max_tokens=2, stop=("abc", "b")), ["ab", "x"])
    assert "".join(pieces) == "abx" and result.finish_reason == "length"


def test_min_tokens_leaves_the_length_limits():
    tokens = [EOS, EOS, TEXT_TOKEN, TEXT_TOKEN]
    pieces, result = feed(checker(min_tokens=3, max_tokens=3), ["a", "b", "c", "d"], tokens)
    assert pieces == ["a", "b", "c"] and result.finish_reason == "length"
    chk = checker(min_tokens=5, max_model_len=8, prompt_len=6)
    pieces, result = feed(chk, ["a", "b", "c"], [EOS] * 3)
    assert pieces == ["a", "b"] and result.finish_reason == "length"


def reference(deltas, stops, include, min_tokens=0):
    """Non-streaming reference: after each delta from the min_tokens-th on, look for a stop
    string in the whole text that ends past the text of the first min_tokens - 1 deltas."""
    text = ""
    floor = len("".join(deltas[: max(0, min_tokens - 1)]))
    for n, delta in enumerate(deltas, 1):
        text += delta
        if n < min_tokens:
            continue
        found = [(text.find(s, max(0, floor - len(s) + 1)), i, s) for i, s in enumerate(stops)]
        hits = [h for h in found if h[0] != -1]
        if hits:
            index, _, stop = min(hits)
            return text[: index + len(stop) if include else index], stop
    return text, None


def test_random_streams_match_the_reference():
    rng = random.Random(0)
    for _ in range(500):
        stops = tuple(
            "".join(rng.choices("ab<>", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        )
        deltas = [
            "".join(rng.choices("ab<>", k=rng.randint(0, 3))) for _ in range(rng.randint(1, 12))
        ]
        include = rng.random() < 0.5
        min_tokens = rng.choice([0, 0, rng.randint(1, len(deltas))])
        chk = checker(
            stop=stops,
            include_stop_str_in_output=include,
            max_tokens=len(deltas),
            min_tokens=min_tokens,
        )
        pieces, result, longest = [], None, max(map(len, stops))
        for delta in deltas:
            result = chk.update(TEXT_TOKEN, delta)
            pieces.append(result.text)
            assert len(chk.held) < longest  # held back: never a whole stop string
            if result.finished:
                break
        text, stop = reference(deltas, stops, include, min_tokens)
        assert "".join(pieces) == text, (stops, deltas, include)
        assert result.stop_reason == stop and result.finish_reason == ("stop" if stop else "length")


def test_with_real_tokenizer_and_detokenizer(tmp_path):
    write_byte_level_tokenizer(tmp_path, 512)
    tok = Tokenizer.from_dir(tmp_path)
    out = tok.encode("Sure 😀 thing</answer> ignored", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"))
    chk = StopChecker(Params(stop=("</answer>",)), (tok.eos_token_id,), 100, 3)
    pieces = []
    for token_id in out:
        result = chk.update(token_id, detok.add(token_id))
        pieces.append(result.text)
        assert "\ufffd" not in result.text and "<" not in result.text
        if result.finished:
            break
    assert "".join(pieces) == "Sure 😀 thing" and result.stop_reason == "</answer>"
