"""Text <-> token ids for a Hugging Face checkpoint folder, on top of `tokenizers`.

Special tokens follow transformers' fast tokenizer (v5, our oracle): when tokenizer.json
exists, transformers drops `add_bos_token`/`add_eos_token` from tokenizer_config.json and
the post-processor in tokenizer.json alone decides what `add_special_tokens=True` adds.
So we never prepend bos ourselves: Llama-3's post-processor already adds
`<|begin_of_text|>`, Llama-2's adds `<s>`, Qwen2's adds nothing, and none is doubled.
tokenizer_config.json only names the bos/eos tokens (and carries the chat template).
`clean_up_tokenization_spaces` is not applied, as in vLLM's streaming path.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unsupported special token entry {value!r} in {CONFIG_FILE}")


def _default_template(value: Any) -> str | None:
    """chat_template is a string, or a list of {"name", "template"} entries (older configs)."""
    if isinstance(value, list):
        value = next((t.get("template") for t in value if t.get("name") == "default"), None)
    return value if isinstance(value, str) else None


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = [b for b in range(256) if b not in keep]
    chars = [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]
    return dict(zip(chars, keep + extra))


class Tokenizer:
    """A loaded tokenizer; build it with `Tokenizer.from_dir(folder)`."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any] | None = None) -> None:
        config = config or {}
        self._backend = backend
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.bos_token_id: int | None = self._id_or_none(self.bos_token)
        self.eos_token_id: int | None = self._id_or_none(self.eos_token)
        self.chat_template: str | None = _default_template(config.get("chat_template"))
        max_len = config.get("model_max_length")
        # transformers writes a huge sentinel (1e30) when the length is unknown.
        known = isinstance(max_len, (int, float)) and max_len < 1e9
        self.model_max_length: int | None = int(max_len) if known else None

        named = [_token_text(config.get(k)) for k in _NAMED_TOKENS]
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        if isinstance(extra, dict):
            extra = list(extra.values())
        named += [_token_text(t) for t in extra]
        ids = {self._id_or_none(t) for t in named} - {None}
        ids |= {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self.all_special_ids: tuple[int, ...] = tuple(sorted(ids))  # type: ignore[arg-type]

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (required) and tokenizer_config.json (optional) from a folder."""
        folder = Path(path)
        file = folder / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {folder}: the checkpoint folder needs a fast (tokenizers) "
                f"tokenizer file; convert a slow tokenizer with transformers' save_pretrained"
            )
        backend = tokenizers.Tokenizer.from_file(str(file))
        config_file = folder / CONFIG_FILE
        config = (
            json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        )
        return cls(backend, config)

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (len(hf_tokenizer)).

        The model's embedding may be larger (padded); it must never be smaller.
        """
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprob `bytes`): exact for byte-level BPE
        (GPT-2 / Llama-3 / Qwen2 style) and for SentencePiece byte-fallback pieces (`<0x0A>`);
        otherwise the UTF-8 of the token decoded alone."""
        piece = self._backend.id_to_token(token_id)
        if piece is not None and token_id not in self.all_special_ids:
            if isinstance(self._backend.decoder, tokenizers.decoders.ByteLevel):
                table = _byte_decoder()
                if all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        return self.decode([token_id], skip_special_tokens=False).encode()

    def id_to_token(self, token_id: int) -> str | None:
        """The vocab entry (e.g. 'Ġworld' in byte-level form) or None for an unknown id."""
        return self._backend.id_to_token(token_id)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}/{self.bos_token_id}, "
            f"eos={self.eos_token!r}/{self.eos_token_id})"
        )
