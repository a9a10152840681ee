"""Streaming detokenization: valid UTF-8 only, deltas add up to the full decode, O(window)."""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from splitserve.cli.tiny_tokenizer import write_byte_level_tokenizer
from splitserve.request.detokenizer import IncrementalDetokenizer
from splitserve.request.tokenizer import Tokenizer

MULTIBYTE = [
    "emoji 👋🏽 family 👨‍👩‍👧 flag 🇫🇷 😀😀",
    "你好，世界。こんにちは 안녕하세요",
    "café naïve façade Ångström crème brûlée",
    "Привет, мир! Γειά σου κόσμε. مرحبا",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_byte_level_tokenizer(path, 512)
    return Tokenizer.from_dir(path)


def stream(tok, prompt_ids, output_ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    return [detok.add(t) for t in output_ids], detok


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_text_streams_whole_characters(tok, text):
    prompt = tok.encode("Say it:")
    out = tok.encode(text, add_special_tokens=False)
    deltas, detok = stream(tok, prompt, out)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(out) == text
    assert detok.flush() == ""
    assert detok.num_output_tokens == len(out)
    # Some characters did span tokens, so some deltas were held back.
    assert "" in deltas


def test_emoji_split_over_byte_tokens_arrives_in_one_delta(tok):
    out = tok.encode("a😀b", add_special_tokens=False)
    assert len(out) >= 4  # 'a', then the emoji's bytes over several tokens, then 'b'
    deltas, _ = stream(tok, [], out)
    assert [d for d in deltas if d] == ["a", "😀", "b"]


@pytest.mark.parametrize("text", ["Hello world, again and again.", " leading space", "a\n\nb"])
def test_ascii_streams_one_delta_per_token(tok, text):
    out = tok.encode(text, add_special_tokens=False)
    deltas, _ = stream(tok, tok.encode("Prompt"), out)
    assert all(deltas) and "".join(deltas) == text


def test_random_tokens_add_up_to_full_decode(tok):
    """Random ids produce invalid UTF-8 too: deltas never end inside a character, and with
    flush() they add up to the full decode (which shows U+FFFD where the bytes are bad)."""
    rng = random.Random(0)
    for _ in range(100):
        out = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        prompt = tok.encode("Prompt text")
        for skip in (True, False):
            deltas, detok = stream(tok, prompt, out, skip_special_tokens=skip)
            assert not any(d.endswith("\ufffd") for d in deltas)
            assert "".join(deltas) + detok.flush() == tok.decode(out, skip_special_tokens=skip)


def test_special_tokens_skipped_or_shown(tok):
    out = tok.encode("Hi", add_special_tokens=False) + [tok.eos_token_id]
    assert stream(tok, [tok.bos_token_id], out)[0][-1] == ""
    assert stream(tok, [tok.bos_token_id], out, skip_special_tokens=False)[0][-1] == "</s>"


def test_unfinished_character_at_the_end_is_flushed(tok):
    out = tok.encode("ok 😀", add_special_tokens=False)[:-1]
    deltas, detok = stream(tok, [], out)
    assert "".join(deltas) == "ok "
    tail = detok.flush()
    assert tail.endswith("\ufffd") and "".join(deltas) + tail == tok.decode(out)
    assert detok.flush() == ""


class CountingTokenizer:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.longest, self.calls = tok, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest, self.calls = max(self.longest, len(ids)), self.calls + 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_is_bounded_by_the_window(tok):
    text = " ".join(MULTIBYTE) * 20
    out = tok.encode(text, add_special_tokens=False)
    counting = CountingTokenizer(tok)
    deltas, _ = stream(counting, tok.encode("A long prompt " * 50), out)
    assert "".join(deltas) == text
    assert len(out) > 1000
    assert counting.longest <= 8  # a 4-byte character over 4 tokens, plus context
    assert counting.calls <= 2 * len(out) + 1


def test_context_keeps_the_leading_space_a_metaspace_decoder_strips():
    """SentencePiece-style decoders drop the leading space of a string; the prompt context
    makes the first delta ' world', as a client appending to the prompt needs."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend)
    assert tok.decode([2, 3]) == "world!"
    deltas, _ = stream(tok, [1], [2, 3, 2])
    assert deltas == [" world", "!", " world"]


def test_ids_beyond_the_tokenizer_vocab_give_no_text(tok):
    """The model's vocab may be larger than the tokenizer's (the tiny model's is)."""
    out = tok.encode("ab", add_special_tokens=False)
    deltas, detok = stream(tok, [], [out[0], tok.vocab_size + 3, out[1], tok.vocab_size])
    assert "".join(deltas) + detok.flush() == "ab" == tok.decode(out)
