"""`decode.py --constrained`: engine ms per decode step with half the batch JSON-schema
constrained, divided by the same batch unconstrained in the same run (issue 35's
structured.json), and the first-token latency of a request with a new schema (compile) and
with a cached one.

The headline rows sample as OpenAI clients do by default (temperature 1, a seed per row), so
the constrained rows diverge and each needs its own mask, as distinct requests do. The greedy
variant (`greedy_identical`) gives every constrained row the same prompt and first token, so
their matchers stay in one state: the engine fills that mask once (token_masks.same_state).
The constrained rows follow SCHEMA, whose `minItems` keeps them from ending before the measured
steps (a constraint takes no ignore_eos), so the batch stays whole.
The preset's tokenizer is the tiny byte-level one (the model's 128k vocabulary padded past
it), so the host mask cost there is that of a small vocabulary: give a --model-dir whose
tokenizer.json is a real one (benchmarks/llama3_checkpoint.py makes the preset's with Llama 3's)
to measure what a 128k vocabulary costs; `tokenizer_vocab` in the JSON says which one ran.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from decode_host_phases import host_phases


def bench_schema(min_items: int, nonce: str = "") -> dict:
    item = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "qty": {"type": "integer", "minimum": 0, "maximum": 99},
            "tag": {"enum": ["new", "used", "refurbished"]},
        },
        "required": ["name", "qty", "tag"],
        "additionalProperties": False,
    }
    return {
        "title": f"bench{nonce}",
        "type": "object",
        "properties": {"rows": {"type": "array", "items": item, "minItems": min_items}},
        "required": ["rows"],
        "additionalProperties": False,
    }


def tokenizer_vocab(args) -> int | None:
    """Size of the tokenizer the grammar masks were built from (None: the preset's tiny one)."""
    if not getattr(args, "model_dir", None):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json")).get_vocab_size()


def first_allowed(matcher, vocab: int) -> int:
    from splitserve.engine.grammar_masks import fill_masks, mask_words

    mask = np.empty((1, mask_words(vocab)), dtype=np.int32)
    fill_masks([matcher], mask)
    return int(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0])


INLINE = 10**9  # engine.beside_min_rows that no batch reaches: every row read on its thread


def _run(engine, batch: int, args, constrained: bool, sampled: bool = True) -> float:
    """Wall ms per step of the serving loop; rows 0, 2, 4, ... constrained when asked; every
    row sampled at temperature 1 with its own seed, or every row greedy."""
    from splitserve.decode_worker.sequence import DecodeInput
    from splitserve.request.constraint import Constraint
    from splitserve.request.sampling_params import SamplingParams

    n = args.steps + 1
    c = Constraint(kind="json_schema", text=json.dumps(bench_schema(n)))
    for i in range(batch):
        how = {"temperature": 1.0, "seed": i} if sampled else {"temperature": 0}
        free = SamplingParams(max_tokens=n, ignore_eos=True, **how)
        tight = SamplingParams(max_tokens=n, constraint=c, **how)
        got = engine.allocator.allocate(-(-args.context // engine.runner.block_size))
        if constrained and i % 2 == 0:
            m = engine.grammars.compile_now(c)
            inp = DecodeInput(
                f"c{i}", [1] * args.context, first_allowed(m, engine.vocab_size), tight, m
            )
        else:
            inp = DecodeInput(f"f{i}", [1] * args.context, 5, free)
        engine.admit(inp, list(got.block_ids), lambda out: None)
    engine.step()
    t0 = time.perf_counter()
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    assert engine.allocator.num_free == engine.allocator.num_usable
    return (time.perf_counter() - t0) * 1e3 / max(steps, 1)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _beside_vs_inline(engine, b: int, args, repeats: int = 7) -> dict:
    """The masked step with the previous step's rows read beside the fill (forced at every
    size; the engine does it from `beside_min_rows` rows) and on the engine thread,
    alternated, medians."""
    default, beside, inline = engine.beside_min_rows, [], []
    try:
        for r in range(repeats):
            for mode in ("beside", "inline") if r % 2 == 0 else ("inline", "beside"):
                engine.beside_min_rows = 1 if mode == "beside" else INLINE
                (beside if mode == "beside" else inline).append(_run(engine, b, args, True))
    finally:
        engine.beside_min_rows = default
    return {"beside_step_ms": _median(beside), "inline_step_ms": _median(inline)}


def first_token_ms(engine, args, nonce: str) -> float:
    """Compile (or cache hit) + admission + the step that makes the first decoded token."""
    from splitserve.decode_worker.sequence import DecodeInput
    from splitserve.request.constraint import Constraint
    from splitserve.request.sampling_params import SamplingParams

    c = Constraint(kind="json_schema", text=json.dumps(bench_schema(4, nonce)))
    got_token: list[int] = []
    t0 = time.perf_counter()
    m = engine.grammars.compile_now(c)
    params = SamplingParams(temperature=0, max_tokens=2, constraint=c)
    blocks = engine.allocator.allocate(-(-args.context // engine.runner.block_size))
    inp = DecodeInput(
        f"t{nonce}", [1] * args.context, first_allowed(m, engine.vocab_size), params, m
    )
    engine.admit(inp, list(blocks.block_ids), lambda out: got_token.extend(out.token_ids))
    while not got_token:
        engine.step()
    ms = (time.perf_counter() - t0) * 1e3
    while engine.has_work:
        engine.step()
    return ms


def structured_results(engine, sizes, args, log) -> dict:
    from splitserve.request.constraint import Constraint

    rows = []
    for b in sizes:
        _run(engine, b, args, False)  # warm the loop (and the MASK graphs) at this size
        _run(engine, b, args, True)
        row = {"batch": b}
        for sampled, name in ((True, ""), (False, "greedy_identical_")):
            plain = _run(engine, b, args, False, sampled)
            masks = engine.graphs.masks
            steps, fill_s = masks.steps, masks.fill_seconds
            half = _run(engine, b, args, True, sampled)
            row |= {
                f"{name}unconstrained_step_ms": plain,
                f"{name}constrained_step_ms": half,
                f"{name}ratio_to_unconstrained": half / plain,
                # host: fill the masks + enqueue their copy, per masked step (overlaps the forward)
                f"{name}mask_host_ms": (masks.fill_seconds - fill_s)
                * 1e3
                / max(masks.steps - steps, 1),
            }
            log(
                f"  batch={b} {name or 'sampled_'}plain={plain:.3f} ms "
                f"half-constrained={half:.3f} ms ratio={half / plain:.3f}"
            )
        ab = _beside_vs_inline(engine, b, args)
        plain = _median([_run(engine, b, args, False) for _ in range(5)])
        row |= {
            "ab_unconstrained_step_ms": plain,
            "ab_beside_ratio": ab["beside_step_ms"] / plain,
            "ab_inline_ratio": ab["inline_step_ms"] / plain,
            **{f"ab_{k}": v for k, v in ab.items()},
        }
        log(
            f"  batch={b} rows read beside the fill {ab['beside_step_ms']:.3f} ms "
            f"({row['ab_beside_ratio']:.3f}x), on the engine thread {ab['inline_step_ms']:.3f} "
            f"ms ({row['ab_inline_ratio']:.3f}x), unconstrained {plain:.3f} ms (medians)"
        )
        rows.append(row)
    with host_phases(engine) as timed:
        _run(engine, max(sizes), args, True)
    phases = timed.ms_per_step()
    log(f"  host phases at batch {max(sizes)}, ms per step: {phases}")
    new = first_token_ms(engine, args, nonce=str(time.time_ns()))
    # the grammar cache compiles a schema's first `lineages` requests anew (independent compiles
    # fill in parallel), then hands out copies: the second request pays a compile, later ones not
    first_token_ms(engine, args, nonce="cached")
    lineage = first_token_ms(engine, args, nonce="cached")
    cached_c = Constraint(kind="json_schema", text=json.dumps(bench_schema(4, "cached")))
    while engine.grammars.compiled_count(cached_c) < engine.grammars.lineages:
        first_token_ms(engine, args, nonce="cached")
    cached = first_token_ms(engine, args, nonce="cached")
    log(
        f"  first token: new schema {new:.2f} ms, a new compile of a cached one {lineage:.2f} "
        f"ms, cached {cached:.2f} ms"
    )
    return {
        "tokenizer_vocab": tokenizer_vocab(args),
        "results": rows,
        "first_token_ms_new_schema": new,
        "first_token_ms_new_lineage": lineage,
        "first_token_ms_cached_schema": cached,
        "host_phases_ms_per_step": {"batch": max(sizes), **phases},
    }
