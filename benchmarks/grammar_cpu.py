"""The grammar engine's host costs (llguidance, CPU only): compile time of a mid-size JSON schema
(new, and cached: the per-request copy), and the per-step mask time of a batch of constrained
rows, each advanced by a random allowed token per step, as the decode engine does.

    python -m benchmarks.grammar_cpu --model ~/.cache/splitserve/models/tiny --batch 64
    python -m benchmarks.grammar_cpu --synthetic-vocab 128000 --batch 64

--synthetic-vocab writes a byte-level tokenizer of that many tokens (the 256 bytes, then words
and fragments drawn from Python's own sources, with and without a leading space), a stand-in
for a 128k-vocabulary model when none is on disk: the mask cost depends on the token strings'
trie, which this approximates, not on the merges. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from splitserve.engine.grammar_masks import fill_masks, mask_words
from splitserve.request.constraint import Constraint
from splitserve.request.grammar_cache import GrammarCache

SCHEMA = {  # mid-size: nested objects, arrays, enums, bounds, formats a form-filling app sends
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
        "status": {"enum": ["active", "inactive", "banned", "pending"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "DE", "FR", "JP", "BR"]},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 16},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "name", "email", "status", "address", "orders"],
    "additionalProperties": False,
}


def synthetic_tokenizer(vocab: int, folder: Path) -> Path:
    """A byte-level BPE tokenizer.json of `vocab` tokens (no merges: the vocab is what counts)."""
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
    table = _bytes_to_unicode()
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
    return folder


def _bytes_to_unicode() -> dict[int, str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint folder with tokenizer.json")
    ap.add_argument("--synthetic-vocab", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    if args.synthetic_vocab:
        folder = synthetic_tokenizer(args.synthetic_vocab, Path(tempfile.mkdtemp()))
        vocab, eos = args.synthetic_vocab, [args.synthetic_vocab - 1]
    else:
        folder = Path(args.model).expanduser()
        cfg = json.loads((folder / "config.json").read_text())
        vocab, eos = cfg["vocab_size"], [cfg["eos_token_id"]]
    cache = GrammarCache(folder, vocab, eos)
    t = time.perf_counter()
    cache.tokenizer()
    tokenizer_s = time.perf_counter() - t
    c = Constraint(kind="json_schema", text=json.dumps(SCHEMA))
    t = time.perf_counter()
    cache.compile_now(c)
    compile_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    matchers = [cache.compile_now(c) for _ in range(args.batch)]
    cached_ms = (time.perf_counter() - t) * 1e3 / args.batch
    masks = np.empty((args.batch, mask_words(vocab)), dtype=np.int32)
    rng = np.random.default_rng(0)
    step_ms = []
    for _ in range(args.steps):
        t = time.perf_counter()
        fill_masks(matchers, masks)
        step_ms.append((time.perf_counter() - t) * 1e3)
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for m, row in zip(matchers, bits):
            allowed = np.flatnonzero(row)
            if not m.is_stopped():
                m.consume_token(int(rng.choice(allowed)))
    print(
        json.dumps(
            {
                "vocab": vocab,
                "batch": args.batch,
                "tokenizer_load_s": round(tokenizer_s, 3),
                "compile_new_ms": round(compile_ms, 2),
                "compile_cached_ms": round(cached_ms, 3),
                "first_mask_ms": round(step_ms[0], 3),  # lazily built lexer states: the most
                "mask_step_ms_median": round(statistics.median(step_ms[1:]), 3),
                "mask_step_ms_p90": round(statistics.quantiles(step_ms[1:], n=10)[-1], 3),
                "mask_step_ms_max": round(max(step_ms[1:]), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
