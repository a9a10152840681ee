"""Decode step time at tensor_parallel_size 1 vs 2 (or any list), side by side in one run.

    python benchmarks/decode_tp.py --model-dir /tmp/llama-3.2-1b --tp-sizes 1,2 --out decode_tp.json

For each TP size the decode engine is built as the decode worker builds it (rank 0 here, the
other ranks spawned, CUDA graphs captured on every rank), then for each batch size B every
sequence holds --context tokens and the serving loop (`engine.step`, greedy, overlap on) runs
--steps steps. Prints per B: engine_step_ms per TP size and speedup = step(TP1) / step(TPn).
Needs as many GPUs as the largest TP size; `--device cpu --preset tiny` smoke-tests the script
(gloo, eager steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from decode import engine_time, log


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, help="checkpoint folder (the preset is written there if empty)")
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="write the JSON result here")
    return p.parse_args(argv)


def measure(model_dir: Path, tp: int, sizes: list[int], args) -> dict[int, float]:
    from splitserve.decode_worker.config import DecodeWorkerConfig
    from splitserve.decode_worker.engine import DecodeEngine
    from splitserve.decode_worker.tp_follower import decode_follower_main
    from splitserve.engine.tp_control import start_ranks

    max_len = 1 << (args.context + 2 * args.steps + 16).bit_length()
    blocks = max(sizes) * -(-max_len // args.block_size) + 2
    cfg = DecodeWorkerConfig(
        engine={"model_path": str(model_dir), "device": args.device,
                "cache": {"block_size": args.block_size, "num_blocks": blocks},
                "scheduler": {"max_batch_size": max(sizes), "max_model_len": max_len},
                "parallel": {"tensor_parallel_size": tp}},
        cuda_graph_sizes=tuple(sizes))
    ranks = start_ranks(cfg.engine, decode_follower_main, cfg)
    engine = DecodeEngine(cfg, ranks.runner)
    try:
        t0 = time.perf_counter()
        engine.warm_up()
        log(f"TP{tp}: graphs {engine.graphs.captured_sizes} captured in {time.perf_counter() - t0:.1f}s")
        out = {}
        for b in sizes:
            engine_time(engine, b, args)  # warm
            out[b] = engine_time(engine, b, args)
            log(f"TP{tp} batch {b}: {out[b]:.3f} ms/step")
        return out
    finally:
        engine.close()
        ranks.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from splitserve.engine.make_model import make_model

    tps = [int(s) for s in args.tp_sizes.split(",") if s]
    if args.device == "cuda" and torch.cuda.device_count() < max(tps):
        print(f"decode_tp benchmark: needs {max(tps)} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.batch_sizes.split(",") if s]
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        make_model(args.preset, model_dir)
    steps = {tp: measure(model_dir, tp, sizes, args) for tp in tps}
    rows = [{"batch": b, **{f"tp{tp}_step_ms": steps[tp][b] for tp in tps},
             **{f"tp{tp}_speedup": steps[tps[0]][b] / steps[tp][b] for tp in tps[1:]}} for b in sizes]
    for row in rows:
        log("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "model": args.preset,
           "context": args.context, "steps": args.steps, "tp_sizes": tps, "results": rows}
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
