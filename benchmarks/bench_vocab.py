"""Tokenizers for the grammar benchmarks (grammar_cpu.py, grammar_engines.py), needing only the
`tokenizers` package (no splitserve, no torch), so they also run in a throw-away venv.

- `llama3_tokenizer`: Llama 3's real 128,256-token vocabulary, from the tiktoken BPE file that
  the `llama-models` package ships (`llama_models/llama3/tokenizer.model`: 128,000 byte-level BPE
  ranks; the 256 special tokens follow), converted to a `tokenizers` tokenizer.json the way
  transformers converts tiktoken files (merges from the ranks, Llama 3's split pattern). Get
  the file without installing anything:

      pip download llama-models==0.3.0 --no-deps -d /tmp/w
      unzip -o /tmp/w/llama_models-0.3.0-py3-none-any.whl 'llama_models/llama3/tokenizer.model' -d /tmp/w

- `synthetic_tokenizer`: a byte-level vocabulary of any size (the 256 bytes, then words and
  fragments from Python's own sources, with and without a leading space) for when no real one
  is at hand: the mask cost depends on the token strings' trie, which this approximates.
"""

from __future__ import annotations

import base64
import random
import re
import sysconfig
from pathlib import Path

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
]
LLAMA3_EOS = 128009  # <|eot_id|>, what an instruct model ends a turn with


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies use it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def llama3_tokenizer(tiktoken_file: Path, folder: Path) -> tuple[Path, int, int]:
    """(folder with tokenizer.json, vocab size, EOS id) of Llama 3, from its tiktoken file."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks: dict[bytes, int] = {}
    for line in Path(tiktoken_file).read_text().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    table = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(table[x] for x in b)

    merges = []
    for tok, rank in ranks.items():
        if len(tok) == 1:
            continue
        local = [
            (tok[:i], tok[i:], rank)
            for i in range(1, len(tok))
            if tok[:i] in ranks and tok[i:] in ranks
        ]
        local.sort(key=lambda m: (ranks[m[0]], ranks[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: m[2])
    vocab = {s(tok): rank for tok, rank in ranks.items()}
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=[(s(a), s(b)) for a, b, _ in merges], ignore_merges=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    n = len(ranks)
    special = LLAMA3_SPECIAL + [
        f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIAL))
    ]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size() == n + 256 and tok.token_to_id("<|eot_id|>") == LLAMA3_EOS
    return folder, n + 256, LLAMA3_EOS


def synthetic_tokenizer(vocab: int, folder: Path) -> tuple[Path, int, int]:
    """(folder with tokenizer.json, vocab, EOS id): a byte-level BPE vocabulary of `vocab`
    tokens, the last one the special EOS (no merges: the vocabulary is what counts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words: dict[str, None] = {}
    src = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(src.rglob("*.py")):
        for w in re.findall(r"[A-Za-z_]+|[0-9]+|[^\sA-Za-z0-9]{1,3}", path.read_text("latin-1")):
            for piece in (w, " " + w, w[: len(w) // 2], " " + w[: len(w) // 2]):
                words.setdefault(piece)
        if len(words) > 4 * vocab:
            break
    rng = random.Random(0)
    picked = sorted(w for w in words if w)
    rng.shuffle(picked)
    table = bytes_to_unicode()
    vocab_map = {table[b]: b for b in range(256)}
    for w in picked:
        if len(vocab_map) == vocab - 1:
            break
        vocab_map.setdefault("".join(table[b] for b in w.encode()), len(vocab_map))
    vocab_map["</s>"] = len(vocab_map)
    tok = Tokenizer(models.BPE(vocab=vocab_map, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder, vocab, vocab - 1


def token_bytes(tokenizer_json: Path) -> tuple[list[bytes], set[int]]:
    """(each id's bytes, the special ids) of a byte-level tokenizer.json."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    back = {c: b for b, c in bytes_to_unicode().items()}
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    out = []
    for i in range(tok.get_vocab_size()):
        piece = tok.id_to_token(i)
        if i in special:
            out.append(piece.encode())
        else:
            out.append(bytes(back[c] for c in piece))
    return out, special
