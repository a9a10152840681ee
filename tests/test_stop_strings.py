"""The incremental stop-string matcher (request/stop_strings.py): the same answers as a brute-force
search of the whole text, a held tail always shorter than the longest stop string, and work
linear in the text fed, whatever the number and length of the stop strings (counted in executed
lines of `feed`, so the bound holds on any machine however loaded)."""

from __future__ import annotations

import random
import sys

import pytest

from splitserve.request.stop_strings import StopStringMatcher


def brute_partial(text: str, stops) -> int:
    """The longest suffix of text that is a proper prefix of a stop string."""
    return max(
        (
            k
            for s in stops
            for k in range(1, min(len(s) - 1, len(text)) + 1)
            if text.endswith(s[:k])
        ),
        default=0,
    )


def brute_match(text: str, before: int, stops):
    """(start, stop) of the earliest stop string ending past text[:before]; at one start the
    one listed first."""
    hits = []
    for rank, s in enumerate(stops):
        i = text.find(s, max(0, before - len(s) + 1))
        if i != -1:
            hits.append((i, rank, s))
    return min(hits)[::2] if hits else None


@pytest.mark.parametrize("alphabet", ["ab", "ab<>/", "aé😀"])
def test_random_streams_agree_with_brute_force(alphabet):
    rng = random.Random(alphabet)
    for _ in range(300):
        stops = [
            "".join(rng.choices(alphabet, k=rng.randint(1, 7))) for _ in range(rng.randint(1, 6))
        ]
        matcher, text = StopStringMatcher(stops), ""
        for _ in range(rng.randint(1, 20)):
            piece = "".join(rng.choices(alphabet, k=rng.randint(0, 5)))
            find = rng.random() < 0.8
            before, text = len(text), text + piece
            got = matcher.feed(piece, find)
            want = brute_match(text, before, stops) if find else None
            assert (None if got is None else (len(text) - got.back, got.stop)) == want, (
                stops,
                text,
            )
            assert matcher.partial_len == brute_partial(text, stops), (stops, text)
            assert matcher.partial_len < max(map(len, stops))  # the held tail's bound


def _lines_in_feed(matcher: StopStringMatcher, pieces) -> int:
    code, count = StopStringMatcher.feed.__code__, 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def calls(frame, event, arg):
        return local if frame.f_code is code else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        for piece in pieces:
            matcher.feed(piece)
    finally:
        sys.settrace(previous)
    return count


def test_work_is_linear_in_the_text_whatever_the_stop_strings():
    # the hard cap (64 strings of 1024 characters), built to keep long partial matches alive
    # and fall back often: "aaa...a" + one other letter; the text is mostly "a"
    rng = random.Random(1)
    huge = ["a" * 1023 + chr(0x100 + i) for i in range(64)]
    tiny = ["ab"]
    text = "".join(rng.choice("aaaaaaab" + chr(0x100)) for _ in range(20_000))
    cuts = sorted(rng.sample(range(1, len(text)), 4_000))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    for stops in (huge, tiny):
        lines = _lines_in_feed(StopStringMatcher(stops), pieces)
        # per character: the loop, at most ~one fallback amortized, one step, one match check
        assert lines <= 10 * len(text) + 12 * len(pieces), (len(stops[0]), lines)
    built = StopStringMatcher(huge)
    assert len(built._goto) <= sum(map(len, huge)) + 1  # the automaton: one node a character


def test_earliest_start_wins_and_ties_go_to_the_first_listed():
    m = StopStringMatcher(["abcd", "c"])
    assert (m.feed("abcd").stop, StopStringMatcher(["c", "abcd"]).feed("abcd").stop) == (
        "abcd",
        "abcd",
    )
    m = StopStringMatcher(["abc", "ab"])
    got = m.feed("abc")
    assert (got.stop, got.back) == ("abc", 3)
    m = StopStringMatcher(["ab", "ab"])  # listed twice: one string
    assert m.feed("xab").stop == "ab"
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])
