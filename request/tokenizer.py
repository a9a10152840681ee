"""Text <-> token ids for a Hugging Face checkpoint folder, on top of `tokenizers`.

Special tokens follow transformers' fast tokenizer (v5, our oracle): when tokenizer.json
exists, transformers drops `add_bos_token`/`add_eos_token` from tokenizer_config.json and
the post-processor in tokenizer.json alone decides what `add_special_tokens=True` adds.
So we never prepend bos ourselves: Llama-3's post-processor already adds
`<|begin_of_text|>`, Llama-2's adds `<s>`, Qwen2's adds nothing, and none is doubled.
tokenizer_config.json only names the special tokens (and may carry the chat template).
`clean_up_tokenization_spaces` is not applied, as in vLLM's streaming path.

The chat template is found where transformers' AutoTokenizer finds it (v5 `_from_pretrained`):
chat_template.jinja (the default) plus additional_chat_templates/NAME.jinja; only when neither
exists, the `chat_template` entry of tokenizer_config.json (a string, or a list of
{"name", "template"}). chat_template.json ({"chat_template": ...}, the processor's legacy file)
is a last resort, as in vLLM, which asks the processor when the tokenizer has no template.
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
# transformers' SPECIAL_TOKENS_ATTRIBUTES: what apply_chat_template passes to the template.
_TEMPLATE_TOKENS = (*_NAMED_TOKENS, "sep_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
LEGACY_TEMPLATE_FILE = "chat_template.json"
TEMPLATE_PLACES = (
    f"{CHAT_TEMPLATE_FILE}, {CHAT_TEMPLATE_DIR}/*.jinja, the chat_template entry of "
    f"{CONFIG_FILE}, and {LEGACY_TEMPLATE_FILE}"
)


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unsupported special token entry {value!r} in {CONFIG_FILE}")


def _named_templates(value: Any) -> str | dict[str, str] | None:
    """One template, or {name: template} (transformers turns the config's list into a dict)."""
    if isinstance(value, list):
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
        return value or None
    return value if isinstance(value, str) else None


def _find_chat_template(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """transformers' order: the template files replace the config's entry when any exists."""
    files = {}
    if (default := folder / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = default.read_text(encoding="utf-8")
    if (extra := folder / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted(extra.glob("*.jinja")):
            files[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    if (found := _named_templates(config.get("chat_template"))) is not None:
        return found
    legacy = folder / LEGACY_TEMPLATE_FILE
    if not legacy.is_file():
        return None
    try:
        return _named_templates(json.loads(legacy.read_text(encoding="utf-8"))["chat_template"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{legacy} is not a JSON object with a chat_template entry ({exc!r}); "
            f"fix it or replace it with a {CHAT_TEMPLATE_FILE} file"
        ) from None


def _template_tokens(config: dict[str, Any]) -> dict[str, str]:
    """transformers' special_tokens_map: the named tokens, then model-specific ones (a string or
    AddedToken `*_token` entry, or a dict of named extra_special_tokens), e.g. Gemma's image_token."""
    named = {k: config.get(k) for k in _TEMPLATE_TOKENS}
    extra = {
        k: v
        for k, v in config.items()
        if k.endswith("_token")
        and k not in named
        and (isinstance(v, str) or (isinstance(v, dict) and v.get("__type") == "AddedToken"))
    }
    for key in (
        "extra_special_tokens",
        "additional_special_tokens",
        "model_specific_special_tokens",
    ):
        if isinstance(config.get(key), dict):
            extra.update(config[key])
    named.update(extra)
    # lenient: an entry that is no token (transformers refuses to load) just gives no variable
    tokens = {k: v.get("content") if isinstance(v, dict) else v for k, v in named.items()}
    return {k: v for k, v in tokens.items() if isinstance(v, str)}


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
        # One template or {name: template}, as transformers' tokenizer.chat_template.
        self.chat_template: str | dict[str, str] | None = _named_templates(
            config.get("chat_template")
        )
        self.template_tokens: dict[str, str] = _template_tokens(config)
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
        """Load tokenizer.json (required), tokenizer_config.json and the chat template (optional)
        from a folder."""
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
        config["chat_template"] = _find_chat_template(folder, config)
        return cls(backend, config)

    def get_chat_template(
        self, name: str | None = None, tools: list[Any] | None = None
    ) -> str | None:
        """The template to render, as transformers' get_chat_template picks it: `name` if given,
        else `tool_use` when tools are passed and the model has one, else `default`. None: the
        model has no template; ValueError: none of its named templates fits."""
        templates = self.chat_template
        if templates is None:
            return None
        if isinstance(templates, str):
            templates = {"default": templates}
        if name is None:
            name = "tool_use" if tools is not None and "tool_use" in templates else "default"
        if name not in templates:
            raise ValueError(
                f"the model has no chat template named {name!r}; its templates are {sorted(templates)}"
            )
        return templates[name]

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
