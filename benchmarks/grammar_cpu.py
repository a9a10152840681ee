"""The grammar engine's host costs in splitserve's own code path (llguidance through
request/grammar_cache.py and engine/grammar_masks.py, CPU only): compile time of a mid-size
JSON schema (new, and cached: the per-request copy), the first mask of a new schema, and the
host work of a decode step with `--batch` constrained rows, as the decode engine does it: each
row's matcher advanced with its token (`consume_token`, engine.py `_accept`), then every row's
mask filled in one call (`fill_masks`: llguidance's parallel fill, off the GIL). Each row takes
a random allowed token per step; a row whose output is complete starts over.

    python -m benchmarks.grammar_cpu --llama3 /tmp/w/llama_models/llama3/tokenizer.model
    python -m benchmarks.grammar_cpu --model ~/.cache/splitserve/models/tiny
    python -m benchmarks.grammar_cpu --synthetic-vocab 128000
    python -m benchmarks.grammar_cpu --llama3 ... --schema bench --batch 32 --threads 16

--llama3 takes Llama 3's tiktoken file (128,256 tokens; benchmarks/bench_vocab.py says where
to get it); --synthetic-vocab writes a byte-level stand-in of that many tokens. Prints one JSON
line: p50 / p90 / max ms per step of advance, fill and both, and the threads that filled.
--schema bench takes decode.py --constrained's schema (short bounded strings: llguidance's slow
rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_vocab, grammar_engines
from bench_vocab import llama3_tokenizer, synthetic_tokenizer  # noqa: E402
from decode_structured import bench_schema  # noqa: E402
from grammar_engines import MID_SCHEMA  # noqa: E402

from splitserve.engine import grammar_masks  # noqa: E402
from splitserve.engine.grammar_masks import fill_masks, mask_words  # noqa: E402
from splitserve.request.constraint import Constraint  # noqa: E402
from splitserve.request.grammar_cache import GrammarCache  # noqa: E402


def _stats(xs: list[float]) -> dict:
    return {
        "p50": round(statistics.median(xs), 3),
        "p90": round(statistics.quantiles(xs, n=10, method="inclusive")[-1], 3),
        "max": round(max(xs), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint folder with tokenizer.json")
    ap.add_argument("--llama3", type=Path, help="Llama 3's tiktoken file (tokenizer.model)")
    ap.add_argument("--synthetic-vocab", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, help="fill threads (default: the engine's choice)")
    ap.add_argument("--schema", choices=("mid", "bench"), default="mid")
    args = ap.parse_args()
    if args.threads:
        grammar_masks.executor_threads = lambda: args.threads
    # mid: nested objects, arrays, enums, bounds, patterns a form-filling app sends
    schema = MID_SCHEMA if args.schema == "mid" else bench_schema(64)
    tmp = Path(tempfile.mkdtemp())
    if args.llama3:
        folder, vocab, eos = llama3_tokenizer(args.llama3, tmp)
        name = f"Llama 3 ({vocab} tokens)"
    elif args.synthetic_vocab:
        folder, vocab, eos = synthetic_tokenizer(args.synthetic_vocab, tmp)
        name = f"synthetic byte-level ({vocab} tokens)"
    else:
        folder = Path(args.model).expanduser()
        cfg = json.loads((folder / "config.json").read_text())
        vocab, eos, name = cfg["vocab_size"], cfg["eos_token_id"], folder.name
    cache = GrammarCache(folder, vocab, [eos], lineages=grammar_masks.grammar_lineages())
    t = time.perf_counter()
    cache.tokenizer()
    tokenizer_s = time.perf_counter() - t
    c = Constraint(kind="json_schema", text=json.dumps(schema))
    t = time.perf_counter()
    first = cache.compile_now(c)
    compile_ms = (time.perf_counter() - t) * 1e3
    one = np.empty((1, mask_words(vocab)), dtype=np.int32)
    t = time.perf_counter()
    fill_masks([first], one)  # llguidance builds lexer states lazily: the first mask pays
    first_mask_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    matchers = [cache.compile_now(c) for _ in range(args.batch)]
    cached_ms = (time.perf_counter() - t) * 1e3 / args.batch
    masks = np.empty((args.batch, mask_words(vocab)), dtype=np.int32)
    rng = np.random.default_rng(0)
    tokens: list[int | None] = [None] * args.batch
    advance, fill, restarts = [], [], 0
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        for m, tok in zip(matchers, tokens):
            if tok is not None:
                m.consume_token(tok)
        t1 = time.perf_counter()
        fill_masks(matchers, masks)
        t2 = time.perf_counter()
        advance.append((t1 - t0) * 1e3)
        fill.append((t2 - t1) * 1e3)
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i, (m, row) in enumerate(zip(matchers, bits)):
            allowed = np.flatnonzero(row)
            allowed = allowed[allowed != eos]
            if len(allowed) == 0:  # complete: only EOS is left; start over
                m.reset()
                tokens[i] = None
                restarts += 1
            else:
                tokens[i] = int(rng.choice(allowed))
    step = [a + f for a, f in zip(advance, fill)]
    print(
        json.dumps(
            {
                "vocab": name,
                "batch": args.batch,
                "steps": args.steps,
                "cpus": os.cpu_count(),
                "fill_threads": grammar_masks.executor_threads(),
                "schema": args.schema,
                "tokenizer_load_s": round(tokenizer_s, 3),
                "compile_new_ms": round(compile_ms, 2),
                "first_mask_ms": round(first_mask_ms, 2),  # one row, a new schema
                "compile_cached_ms": round(cached_ms, 3),
                "first_step_ms": round(step[0], 3),  # 64 rows at the start: states shared
                "step_ms": _stats(step[1:]),  # advance + fill: the host's part of a step
                "advance_ms": _stats(advance[1:]),
                "fill_ms": _stats(fill[1:]),
                "rows_completed": restarts,
            }
        )
    )


if __name__ == "__main__":
    main()
