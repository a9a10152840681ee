"""What a prompt's first token costs through the prefill engine, greedy against sampled (the
OpenAI default: temperature 1), side by side in one run: the sampler alone on the prompt's
logits, one `ModelRunner.prefill` step, and the whole engine path (queue, step thread, sampling,
lease) at each prompt length. Medians, synchronised.

    python benchmarks/prefill_first_token.py --model-dir /tmp/l1b --lengths 128,1024 \\
        --out first_token.json
    python benchmarks/prefill_first_token.py --preset tiny --device cpu --lengths 32   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--model-dir", default=None, help="written from --preset when it has none")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", default="128,1024")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from splitserve.cli.make_model import make_model
    from splitserve.config.engine_config import EngineConfig
    from splitserve.engine.model_runner import ModelRunner, PrefillChunk
    from splitserve.engine.sampler import SeqSamplingInfo
    from splitserve.prefill_worker.config import PrefillWorkerConfig
    from splitserve.prefill_worker.engine import PrefillEngine
    from splitserve.request.sampling_params import SamplingParams

    lengths = [int(x) for x in args.lengths.split(",")]
    root = Path(os.environ.get("SPLITSERVE_CACHE", Path(tempfile.gettempdir()) / "splitserve"))
    model_dir = Path(args.model_dir or root / "models" / args.preset)
    if not (model_dir / "config.json").is_file():
        print(f"writing the {args.preset} checkpoint to {model_dir} ...", file=sys.stderr)
        make_model(args.preset, model_dir)
    bs, longest = 16, max(lengths)
    cfg = EngineConfig(
        model_path=str(model_dir),
        device=args.device,
        cache={"block_size": bs, "num_blocks": 4 * -(-longest // bs) + 8},
        scheduler={"max_model_len": longest + 16, "max_num_batched_tokens": max(longest, 16)},
    )
    runner = ModelRunner(cfg)
    cuda = runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    vocab = runner.model_config.vocab_size
    modes = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        "sampled": SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True),
    }

    def prompt(n: int, salt: int) -> list[int]:
        return [(7919 * (salt + 3) + 104729 * j) % (vocab - 3) + 3 for j in range(n)]

    def median_ms(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.iters):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    async def measure() -> tuple[list[dict], bool]:
        engine = PrefillEngine(
            PrefillWorkerConfig(engine=cfg, enable_prefix_cache=False, warmup=True), runner
        )
        await engine.start()
        rows = []
        try:
            for n in lengths:
                chunk = PrefillChunk(prompt(n, 0), 0, list(range(1, 1 + -(-n // bs))))
                logits = runner.prefill([chunk])
                row = {"prompt_tokens": n, "runner_ms": median_ms(lambda: runner.prefill([chunk]))}
                for mode, params in modes.items():
                    info = [SeqSamplingInfo(params, chunk.token_ids, ())]
                    row[f"sampler_{mode}_ms"] = median_ms(
                        lambda info=info: engine.sampler.sample(logits, info)
                    )
                    times = []
                    for i in range(args.iters + 3):
                        start = time.perf_counter()
                        res = await engine.prefill(f"{mode}-{n}-{i}", prompt(n, i), params, 60.0)
                        times.append(time.perf_counter() - start)
                        engine.release_lease(res.lease.lease_id)
                    row[f"engine_{mode}_ms"] = statistics.median(times[3:]) * 1e3
                row["sampled_over_greedy"] = row["engine_sampled_ms"] / row["engine_greedy_ms"]
                print(
                    f"{n:>6} tokens: engine greedy {row['engine_greedy_ms']:.3f} ms, sampled "
                    f"{row['engine_sampled_ms']:.3f} ms ({row['sampled_over_greedy']:.2f}x); "
                    f"sampler alone {row['sampler_greedy_ms']:.3f} / "
                    f"{row['sampler_sampled_ms']:.3f} ms; one runner step {row['runner_ms']:.3f} ms",
                    file=sys.stderr,
                )
                rows.append(row)
            free = engine.allocator.num_free == engine.allocator.num_usable  # every lease back
        finally:
            await engine.stop()
        return rows, free

    rows, free = asyncio.run(measure())
    result = {
        "benchmark": "prefill_first_token",
        "preset": args.preset,
        "device_name": torch.cuda.get_device_name(runner.device) if cuda else "cpu",
        "torch": torch.__version__,
        "results": rows,
        "all_blocks_free_at_end": free,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
