"""Decode-step benchmark on one GPU: graph replay vs eager vs HBM roofline vs transformers.

Measures the CUDA-graph decode step against the eager step and the HBM roofline, the whole
decode engine loop, and transformers `generate` on the same model as the peer.

    python benchmarks/decode.py --model-dir /tmp/llama-3.2-1b --out decode.json

Per batch size B (default 1, 8, 32, 64, 128, 256), every sequence holding --context tokens:

    graph_step_ms    one graph replay, timed with CUDA events over --steps replays
    eager_step_ms    the same step body run eagerly (same kernels, no graph)
    roofline_ms      (weight bytes + KV bytes read) / copy bandwidth measured in this run
    roofline_ratio   roofline_ms / graph_step_ms (1.0 = at the memory-bandwidth limit)
    engine_step_ms   the serving loop (scheduler, overlap, stop checks) per step, wall clock
    hf_step_ms       transformers generate per new token (batch 1 and 64; static cache if it runs)

With --sampling MODES (comma list, or "all"), it measures instead the engine step per sampling
mode against greedy in the same run (decode_sampling.py; issue 30's decode_sampling.json):

    python benchmarks/decode.py --model-dir /tmp/llama-3.2-1b --sampling all \
        --batch-sizes 1,8,64,256 --out decode_sampling.json

With --constrained, it measures instead the engine step with half the batch JSON-schema
constrained against none, and a new vs a cached schema's first-token latency
(decode_structured.py; issue 35's structured.json):

    python benchmarks/decode.py --model-dir /tmp/llama-3.2-1b --constrained \
        --batch-sizes 2,64 --out structured.json

The model is the `llama-3.2-1b` shape preset (bf16, 1.2B parameters, random weights: speed
does not depend on the values), written to --model-dir on first use.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from decode_sampling import MODES, sampling_results
from decode_structured import structured_results
from decode_timing import copy_bandwidth, engine_time, kernel_times  # the step timings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="\n".join(__doc__.splitlines()[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model-dir",
        required=True,
        help="checkpoint folder (the preset is written there if empty)",
    )
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    p.add_argument(
        "--context", type=int, default=512, help="tokens per sequence when timing starts"
    )
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per measurement")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--hf-batch-sizes", default="1,64", help="transformers peer batch sizes ('' to skip)"
    )
    p.add_argument(
        "--device",
        default="cuda",
        help="cuda (the measurement) or cpu (a smoke test of the script)",
    )
    p.add_argument(
        "--sampling",
        default="",
        help=f"measure these sampling modes against greedy instead ('all' = {','.join(MODES)})",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="--sampling: rounds per mode (the median is kept)"
    )
    p.add_argument(
        "--constrained",
        action="store_true",
        help="measure half the batch JSON-schema constrained against none instead",
    )
    p.add_argument(
        "--fill-threads",
        type=int,
        help="--constrained: threads that fill the token masks (default: the engine's choice)",
    )
    p.add_argument("--out", help="write the JSON result here")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[decode-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def hf_peer(torch, model_dir: str, batch: int, args) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if next(model.parameters()).dtype != dtype:  # transformers < 4.56 knows only torch_dtype
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype)
    model = model.to(args.device).eval()
    ids = torch.randint(3, model.config.vocab_size, (batch, args.context), device=args.device)
    mask = torch.ones_like(ids)
    result = {"batch": batch}
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for cache in ("static", "dynamic"):
        kw = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
        if cache == "static":
            kw["cache_implementation"] = "static"
        try:

            def gen(n: int) -> float:
                sync()
                t0 = time.perf_counter()
                model.generate(ids, min_new_tokens=n, max_new_tokens=n, **kw)
                sync()
                return time.perf_counter() - t0

            gen(args.steps + 1)  # warm-up (and compile, for the static cache)
            per_token = (gen(args.steps + 1) - gen(1)) / args.steps
            result.update(
                cache=cache, hf_step_ms=per_token * 1e3, hf_tokens_per_s=batch / per_token
            )
            return result
        except Exception as exc:  # noqa: BLE001 - the peer is best effort; say why
            log(f"transformers generate with the {cache} cache failed: {exc!r}")
            result[f"{cache}_error"] = repr(exc)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "decode benchmark: needs a CUDA GPU (run it through the device tool); --device cpu "
            "--preset tiny smoke-tests the script",
            file=sys.stderr,
        )
        return 2
    from splitserve.cli.make_model import make_model
    from splitserve.decode_worker.config import DecodeWorkerConfig
    from splitserve.decode_worker.engine import DecodeEngine
    from splitserve.decode_worker.graph_runner import GraphRunner

    sizes = [int(s) for s in args.batch_sizes.split(",") if s]
    if args.fill_threads:
        from splitserve.engine import grammar_masks

        grammar_masks.executor_threads = lambda: args.fill_threads
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        log(f"writing the {args.preset} preset to {model_dir}")
        make_model(args.preset, model_dir)
    max_len = 1 << (args.context + 3 * args.steps + 16).bit_length()
    blocks = max(sizes) * -(-max_len // args.block_size) + 2
    cfg = DecodeWorkerConfig(
        engine={
            "model_path": str(model_dir),
            "device": args.device,
            "cache": {"block_size": args.block_size, "num_blocks": blocks},
            "scheduler": {"max_batch_size": max(sizes), "max_model_len": max_len},
        },
        cuda_graph_sizes=tuple(sizes),
    )
    log(f"loading {model_dir} (max_model_len {max_len}, {blocks} KV blocks)")
    engine = DecodeEngine(cfg)
    t0 = time.perf_counter()
    engine.warm_up()
    log(f"captured graphs {engine.graphs.captured_sizes} in {time.perf_counter() - t0:.1f}s")
    if args.sampling:
        modes = MODES if args.sampling == "all" else tuple(args.sampling.split(","))
        unknown = set(modes) - set(MODES)
        if unknown:
            print(f"decode benchmark: unknown sampling modes {sorted(unknown)}", file=sys.stderr)
            return 2
        results = sampling_results(
            engine, sizes, ("greedy", *modes[modes[0] == "greedy" :]), args, log
        )
        return write_out(
            args,
            torch,
            {
                "context": args.context,
                "steps": args.steps,
                "repeats": args.repeats,
                "results": results,
            },
        )
    if args.constrained:
        found = structured_results(engine, sizes, args, log)
        from splitserve.engine.grammar_masks import executor_threads

        found["fill_threads"] = executor_threads()
        return write_out(args, torch, {"context": args.context, "steps": args.steps, **found})
    eager_runner = GraphRunner(engine.runner, max(sizes))
    bw = copy_bandwidth(torch, args.device, (2 << 30) if args.device == "cuda" else (64 << 20))
    log(f"device copy bandwidth {bw / 1e9:.0f} GB/s")
    r = engine.runner
    weight_bytes = sum(
        p.numel() * p.element_size() for p in r.model.parameters()
    )  # lm_head tied: once
    kv_per_token = r.geometry.bytes_per_block // r.block_size
    results = []
    for b in sizes:
        row = {"batch": b, **kernel_times(torch, engine, eager_runner, b, args)}
        avg_ctx = args.context + 1 + args.steps / 2
        roof = (weight_bytes + b * avg_ctx * kv_per_token) / bw * 1e3
        step = row.get("graph_step_ms", row["eager_step_ms"])
        row.update(
            tokens_per_s=b / step * 1e3,
            roofline_ms=roof,
            roofline_ratio=roof / step,
            graph_speedup=row["eager_step_ms"] / step,
            engine_step_ms=engine_time(engine, b, args),
        )
        row["engine_tokens_per_s"] = b / row["engine_step_ms"] * 1e3
        log(
            "  ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            )
        )
        results.append(row)
    engine.close()
    del eager_runner, engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    hf = []
    for b in [int(s) for s in args.hf_batch_sizes.split(",") if s]:
        log(f"transformers generate, batch {b}")
        peer = hf_peer(torch, str(model_dir), b, args)
        ours = next((x for x in results if x["batch"] == b), None)
        if ours and "hf_step_ms" in peer:
            peer["splitserve_speedup"] = peer["hf_step_ms"] / ours["engine_step_ms"]
        log(str(peer))
        hf.append(peer)
    out = {
        "context": args.context,
        "steps": args.steps,
        "block_size": args.block_size,
        "copy_bandwidth_gbs": bw / 1e9,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "results": results,
        "transformers": hf,
    }
    return write_out(args, torch, out)


def write_out(args, torch, fields: dict) -> int:
    out = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": args.preset,
        **fields,
    }
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text)
        log(f"wrote {args.out}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
