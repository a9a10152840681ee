r"""Decode step time at tensor_parallel_size 1 vs 2 (or any list), side by side in one run, per
model shape preset; also checks that every TP size gives TP1's greedy tokens.

    python benchmarks/decode_tp.py --model-dir /tmp/tp-models --presets llama-3.2-1b,llama-3.1-8b \
        --tp-sizes 1,2 --out decode_tp.json

For each preset (checkpoint in --model-dir/<preset>, written there with random weights when
missing) and TP size, the decode engine is built as the decode worker builds it (rank 0 here,
the other ranks spawned, CUDA graphs captured on every rank). Then:

  timing   for each batch size B every sequence holds --context tokens and the serving loop
           (`engine.step`, greedy, overlap on) runs --steps steps: engine_step_ms per TP size and
           speedup = step(TP1) / step(TPn)
  greedy   --check-prompts prompts computed by the engine itself (colocated: prompt forward, then
           --check-tokens greedy steps); each TP size's tokens are compared with the first TP
           size's: greedy_match, and the first mismatching (prompt, position) when they differ
           (bf16 all-reduces sum in another order than one GPU's matmul: a late divergence on
           near-tied logits is possible, an early one is a bug)

Needs as many GPUs as the largest TP size; `--device cpu --presets tiny` smoke-tests the script
(gloo, eager steps). Exit status 1 when any greedy check mismatches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from decode import log
from decode_timing import engine_time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="\n".join(__doc__.splitlines()[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model-dir",
        required=True,
        help="folder of the checkpoints, one per preset (DIR/<preset>)",
    )
    p.add_argument(
        "--presets", "--preset", default="llama-3.2-1b,llama-3.1-8b", help="comma-separated presets"
    )
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--check-prompts",
        type=int,
        default=4,
        help="prompts of the greedy TP1-vs-TPn check (0: skip)",
    )
    p.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per check prompt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="write the JSON result here")
    return p.parse_args(argv)


def check_prompts(vocab: int, n: int) -> list[list[int]]:
    """Deterministic prompts of 16..64 tokens (ids 3.. avoid the special tokens)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    lengths = torch.randint(16, 65, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n_tok,), generator=gen).tolist() for n_tok in lengths]


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine computes each prompt itself (no KV hand-over) and decodes greedily."""
    from splitserve.decode_worker.sequence import DecodeInput
    from splitserve.request.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.submit(
            DecodeInput(f"check{i}", prompt, None, params),
            lambda o, i=i: out[i].extend(o.token_ids),
        )
    while engine.has_work:
        engine.step()
    assert engine.allocator.num_free == engine.allocator.num_usable, (
        "KV blocks leaked by the greedy check"
    )
    return out


def first_mismatch(ref: list[list[int]], got: list[list[int]]) -> dict | None:
    for i, (a, b) in enumerate(zip(ref, got)):
        for pos, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return {"prompt": i, "position": pos, "tp1_token": x, "token": y}
        if len(a) != len(b):
            return {"prompt": i, "position": min(len(a), len(b)), "tp1_len": len(a), "len": len(b)}
    return None


def measure(
    model_dir: Path, tp: int, sizes: list[int], prompts, args
) -> tuple[dict[int, float], list]:
    from splitserve.decode_worker.config import DecodeWorkerConfig
    from splitserve.decode_worker.engine import DecodeEngine
    from splitserve.decode_worker.tp_follower import decode_follower_main
    from splitserve.engine.tp_control import start_ranks

    max_len = 1 << (args.context + 2 * args.steps + 16).bit_length()
    blocks = max(max(sizes), len(prompts)) * -(-max_len // args.block_size) + 2
    cfg = DecodeWorkerConfig(
        engine={
            "model_path": str(model_dir),
            "device": args.device,
            "cache": {"block_size": args.block_size, "num_blocks": blocks},
            "scheduler": {
                "max_batch_size": max(max(sizes), len(prompts)),
                "max_model_len": max_len,
            },
            "parallel": {"tensor_parallel_size": tp},
        },
        cuda_graph_sizes=tuple(sizes),
    )
    ranks = start_ranks(cfg.engine, decode_follower_main, cfg)
    engine = DecodeEngine(cfg, ranks.runner)
    try:
        t0 = time.perf_counter()
        engine.warm_up()
        log(
            f"TP{tp}: graphs {engine.graphs.captured_sizes} captured in {time.perf_counter() - t0:.1f}s"
        )
        tokens = greedy_tokens(engine, prompts, args.check_tokens) if prompts else []
        out = {}
        for b in sizes:
            engine_time(engine, b, args)  # warm
            out[b] = engine_time(engine, b, args)
            log(f"TP{tp} batch {b}: {out[b]:.3f} ms/step")
        return out, tokens
    finally:
        engine.close()
        ranks.close()


def run_preset(preset: str, args, tps: list[int], sizes: list[int]) -> dict:
    from splitserve.cli.make_model import make_model
    from splitserve.config.hf_config import load_model_config

    model_dir = Path(args.model_dir) / preset
    if not (model_dir / "config.json").is_file():
        log(f"writing the {preset} preset to {model_dir}")
        make_model(preset, model_dir)
    prompts = check_prompts(load_model_config(model_dir).vocab_size, args.check_prompts)
    steps, tokens = {}, {}
    for tp in tps:
        steps[tp], tokens[tp] = measure(model_dir, tp, sizes, prompts, args)
    rows = [
        {
            "batch": b,
            **{f"tp{tp}_step_ms": steps[tp][b] for tp in tps},
            **{f"tp{tp}_speedup": steps[tps[0]][b] / steps[tp][b] for tp in tps[1:]},
        }
        for b in sizes
    ]
    greedy = {
        f"tp{tp}": {
            "greedy_match": tokens[tp] == tokens[tps[0]],
            "first_mismatch": first_mismatch(tokens[tps[0]], tokens[tp]),
        }
        for tp in tps[1:]
    }
    for row in rows:
        log(
            f"{preset}  "
            + "  ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            )
        )
    for name, g in greedy.items():
        log(
            f"{preset}  {name} greedy tokens vs tp{tps[0]}: "
            f"{'match' if g['greedy_match'] else 'MISMATCH at ' + json.dumps(g['first_mismatch'])}"
        )
    return {
        "results": rows,
        "greedy_check": {"prompts": len(prompts), "tokens": args.check_tokens, **greedy},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    tps = [int(s) for s in args.tp_sizes.split(",") if s]
    if args.device == "cuda" and torch.cuda.device_count() < max(tps):
        print(
            f"decode_tp benchmark: needs {max(tps)} GPUs, found {torch.cuda.device_count()}",
            file=sys.stderr,
        )
        return 2
    sizes = [int(s) for s in args.batch_sizes.split(",") if s]
    presets = [s for s in args.presets.split(",") if s]
    out = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "context": args.context,
        "steps": args.steps,
        "tp_sizes": tps,
        "presets": {preset: run_preset(preset, args, tps, sizes) for preset in presets},
    }
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    ok = all(
        g["greedy_match"]
        for p in out["presets"].values()
        for k, g in p["greedy_check"].items()
        if k.startswith("tp")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
