"""The tiny byte-level tokenizer files and the Tokenizer wrapper, checked against transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.cli.tiny_tokenizer import write_byte_level_tokenizer
from splitserve.request.tokenizer import Tokenizer

VOCAB = 512
TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  \n\ttabs\r\n",
    "The quick brown fox jumps over the lazy dog 0123456789.",
    "café naïve façade Ångström crème brûlée",
    "你好，世界。こんにちは 안녕하세요",
    "emoji 👋🏽 family 👨‍👩‍👧 flag 🇫🇷 😀",
    "mixed: Привет <s> inside </s> text",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_byte_level_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def tok(folder) -> Tokenizer:
    return Tokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def hf_auto():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer


def test_files_are_byte_identical_across_runs(tmp_path, folder):
    write_byte_level_tokenizer(tmp_path / "again", VOCAB)
    # A fresh interpreter with another hash seed must write the same bytes as well.
    code = (
        "import sys; from pathlib import Path; from splitserve.cli.tiny_tokenizer import "
        f"write_byte_level_tokenizer as w; w(Path(sys.argv[1]), {VOCAB})"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "proc")], check=True, env=env)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        expected = (folder / name).read_bytes()
        assert (tmp_path / "again" / name).read_bytes() == expected
        assert (tmp_path / "proc" / name).read_bytes() == expected


@pytest.mark.parametrize("size", [260, 300, VOCAB, 1024])
def test_vocab_size_is_exact(tmp_path, size):
    write_byte_level_tokenizer(tmp_path, size)
    assert Tokenizer.from_dir(tmp_path).vocab_size == size


@pytest.mark.parametrize("size", [100, 259, 100_000])
def test_impossible_vocab_size_is_refused(tmp_path, size):
    with pytest.raises(ValueError, match="vocab_size"):
        write_byte_level_tokenizer(tmp_path, size)


def test_special_tokens(tok):
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.all_special_ids == (0, 1, 2, 3)
    assert [tok.id_to_token(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    assert tok.id_to_token(VOCAB + 10) is None
    assert tok.model_max_length == 2048
    assert "messages" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and ids[1:2] != [tok.bos_token_id]
    assert ids[1:] == tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    if "<s>" not in text:
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_special_token_text_in_input_is_a_special_token(tok):
    ids = tok.encode("a</s>b", add_special_tokens=False)
    assert tok.eos_token_id in ids
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "a</s>b"


def test_multibyte_characters_span_several_tokens(tok):
    """The detokenizer tests rely on this: one character, several tokens."""
    for char in ("👋", "😀", "🇫"):
        ids = tok.encode(char, add_special_tokens=False)
        assert len(ids) >= 2, char
        assert "\ufffd" in tok.decode(ids[:1])


def test_missing_tokenizer_json_names_folder_and_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json") as info:
        Tokenizer.from_dir(tmp_path / "ckpt")
    assert str(tmp_path / "ckpt") in str(info.value)


def test_without_config_the_post_processor_still_decides(tmp_path, folder):
    shutil.copy(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.bos_token_id is None and tok.eos_token_id is None
    assert tok.encode("hi")[0] == 1
    assert tok.all_special_ids == (0, 1, 2, 3)  # added tokens marked special


def test_transformers_loads_and_agrees(folder, tok, hf_auto):
    hf = hf_auto.from_pretrained(folder)
    assert (len(hf), hf.bos_token_id, hf.eos_token_id) == (
        tok.vocab_size,
        tok.bos_token_id,
        tok.eos_token_id,
    )
    assert sorted(hf.all_special_ids) == list(tok.all_special_ids)
    for text in TEXTS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert hf.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert hf.decode(ids, skip_special_tokens=skip) == tok.decode(
                    ids, skip_special_tokens=skip
                )
    messages = [{"role": "user", "content": "hi"}]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def _bos_pp(bos: str, bos_id: int) -> dict:
    return {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


@pytest.mark.parametrize(
    "config_edit, post_processor, bos_count",
    [
        (
            {"add_bos_token": False},
            "keep",
            1,
        ),  # transformers ignores the flag next to tokenizer.json
        ({"add_bos_token": None}, "keep", 1),  # Llama-3 style: only the post-processor adds bos
        ({"add_bos_token": True}, None, 0),  # no post-processor: nothing is added
        ({"add_bos_token": True}, "bos", 1),  # explicit flag + bos post-processor: not doubled
    ],
)
def test_bos_handling_mirrors_transformers(
    tmp_path, folder, hf_auto, config_edit, post_processor, bos_count
):
    config = json.loads((folder / "tokenizer_config.json").read_text()) | config_edit
    config = {key: value for key, value in config.items() if value is not None}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    data = json.loads((folder / "tokenizer.json").read_text())
    if post_processor != "keep":
        data["post_processor"] = None if post_processor is None else _bos_pp("<s>", 1)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))

    ours = Tokenizer.from_dir(tmp_path).encode("Hello")
    assert ours.count(1) == bos_count
    assert hf_auto.from_pretrained(tmp_path).encode("Hello") == ours
