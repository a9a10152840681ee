"""Prefill throughput of the prefill worker's model path, side by side with transformers.

For each case (one prompt of 512, 2k and 8k tokens, and a batch of mixed lengths) it times:

* `runner`: one `ModelRunner.prefill` step over the paged KV pool (what one engine step does);
* `engine`: the PrefillEngine end to end (scheduler, chunking under --max-num-batched-tokens,
  first-token sampling, leases), prefix cache off so every run computes every token;
* `transformers`: AutoModelForCausalLM forward with SDPA attention on the same token ids
  (the mixed batch right-padded with an attention mask, as batched HF inference runs), only
  the last position's logits (`logits_to_keep=1`), no KV cache returned.

It reports tokens/s, MFU = (2 * matmul params * tokens + causal attention FLOPs) / time over the
bf16 matmul rate measured in the same run (8192^3 GEMMs), and the ratio to transformers.

    python benchmarks/prefill.py --out results/prefill.json             # H200: llama-3.2-1b shape
    python benchmarks/prefill.py ... --fast-out results/prefill_fast.json   # + prefill_fast.py
    python benchmarks/prefill.py --preset tiny --device cpu --lengths 32 --mixed 8,16 --iters 1
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--preset", default="llama-3.2-1b", help="make_model preset whose shape is benchmarked"
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="checkpoint folder; written from --preset when it has no "
        "config.json (default: $SPLITSERVE_CACHE or the temp dir, per preset)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--lengths", default="512,2048,8192", help="comma-separated single-prompt lengths"
    )
    p.add_argument(
        "--mixed",
        default="64,300,512,1000,1500,2048,2800",
        help="comma-separated prompt lengths of the mixed batch ('' to skip)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="engine step budget")
    p.add_argument(
        "--iters", type=int, default=5, help="timed runs per measurement (median reported)"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument(
        "--no-engine", action="store_true", help="skip the end-to-end engine measurement"
    )
    p.add_argument("--out", default=None, help="write the JSON result here")
    _fast().add_arguments(p)
    return p.parse_args(argv)


def _fast():
    """benchmarks/prefill_fast.py (issue 31's table), beside this file (loaded by path: the
    folder on sys.path would shadow Hugging Face's `kernels` with benchmarks/kernels.py)."""
    path = Path(__file__).resolve().parent / "prefill_fast.py"
    spec = importlib.util.spec_from_file_location("prefill_fast", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class Bench:
    def __init__(self, args, torch):
        self.args, self.torch = args, torch
        self.device = torch.device(args.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def time(self, fn) -> float:
        """Median wall seconds of fn() (device synchronized around each run)."""
        for _ in range(self.args.warmup):
            fn()
        self.sync()
        runs = []
        for _ in range(self.args.iters):
            start = time.perf_counter()
            fn()
            self.sync()
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    def matmul_flops(self) -> float:
        """Achieved bf16 dense GEMM rate (FLOP/s): the MFU denominator."""
        torch = self.torch
        n = 8192 if self.device.type == "cuda" else 512
        a = torch.randn(n, n, dtype=torch.bfloat16, device=self.device)
        b = torch.randn(n, n, dtype=torch.bfloat16, device=self.device)
        return 2 * n**3 / self.time(lambda: a @ b)


def model_flops(mc, lengths: list[int]) -> float:
    """2 * matmul params per token (+ the lm_head once per sequence) + causal attention."""
    h, q, kv, inter = mc.hidden_size, mc.q_size, mc.kv_size, mc.intermediate_size
    per_token = mc.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    attn = sum(4 * mc.num_hidden_layers * q * n * (n + 1) / 2 for n in lengths)  # QK^T and PV
    return 2 * per_token * sum(lengths) + 2 * h * mc.vocab_size * len(lengths) + attn


def prompts_for(lengths: list[int], vocab: int) -> list[list[int]]:
    return [
        [(7919 * (i + 1) + 104729 * j) % (vocab - 3) + 3 for j in range(n)]
        for i, n in enumerate(lengths)
    ]


def run_runner(bench: Bench, runner, prompts) -> float:
    from splitserve.engine.model_runner import PrefillChunk

    bs, chunks, next_block = runner.block_size, [], 1
    for p in prompts:
        n = -(-len(p) // bs)
        chunks.append(PrefillChunk(p, 0, list(range(next_block, next_block + n))))
        next_block += n
    return bench.time(lambda: runner.prefill(chunks))


def run_engine(bench: Bench, runner, cfg, prompts, sampled: bool = False) -> float:
    """Greedy first tokens, or (`sampled`) the OpenAI defaults' (temperature 1, top-p 1)."""
    import asyncio

    from splitserve.prefill_worker.engine import PrefillEngine
    from splitserve.request.sampling_params import SamplingParams

    temperature = 1.0 if sampled else 0.0
    params = SamplingParams(temperature=temperature, max_tokens=2, ignore_eos=True)

    async def all_prompts(engine, tag: str) -> None:
        results = await asyncio.gather(
            *(engine.prefill(f"{tag}-{i}", p, params, 60.0) for i, p in enumerate(prompts))
        )
        for r in results:
            engine.release_lease(r.lease.lease_id)

    async def measure() -> float:
        engine = PrefillEngine(cfg, runner)
        await engine.start()
        try:
            for w in range(bench.args.warmup):
                await all_prompts(engine, f"w{w}")
            runs = []
            for i in range(bench.args.iters):
                start = time.perf_counter()
                await all_prompts(engine, f"r{i}")
                runs.append(time.perf_counter() - start)
            return statistics.median(runs)
        finally:
            await engine.stop()

    return asyncio.run(measure())


def run_transformers(bench: Bench, hf, prompts) -> float:
    torch = bench.torch
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    ids, mask = ids.to(bench.device), mask.to(bench.device)
    kwargs = {} if len(prompts) == 1 else {"attention_mask": mask}
    accepted = inspect.signature(
        hf.forward
    ).parameters  # num_logits_to_keep before transformers 4.50
    keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in accepted), None)
    if keep:
        kwargs[keep] = 1

    def forward():
        with torch.inference_mode():
            hf(input_ids=ids, use_cache=False, **kwargs)

    return bench.time(forward)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    from splitserve.cli.make_model import make_model
    from splitserve.config.engine_config import EngineConfig
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.prefill_worker.config import PrefillWorkerConfig

    cases = [(str(n), [n]) for n in _ints(args.lengths)]
    if _ints(args.mixed):
        cases.append(("mixed", _ints(args.mixed)))
    root = Path(os.environ.get("SPLITSERVE_CACHE", Path(tempfile.gettempdir()) / "splitserve"))
    model_dir = Path(args.model_dir or root / "models" / args.preset)
    if not (model_dir / "config.json").is_file():
        print(f"writing the {args.preset} checkpoint to {model_dir} ...", file=sys.stderr)
        make_model(args.preset, model_dir)

    bs = args.block_size
    longest = max(max(lengths) for _, lengths in cases)
    blocks = max(sum(-(-n // bs) for n in lengths) for _, lengths in cases) + 1
    engine_cfg = EngineConfig(
        model_path=str(model_dir),
        device=args.device,
        cache={"block_size": bs, "num_blocks": blocks + 1},
        scheduler={
            "max_model_len": longest + 16,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
    )
    runner = ModelRunner(engine_cfg)
    bench = Bench(args, torch)
    peak = bench.matmul_flops()
    mc = runner.model_config
    worker_cfg = PrefillWorkerConfig(engine=engine_cfg, enable_prefix_cache=False, warmup=False)
    hf = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=runner.dtype, attn_implementation="sdpa"
        )
        hf = hf.to(bench.device).eval()

    cuda = bench.device.type == "cuda"
    result = {
        "benchmark": "prefill",
        "preset": args.preset,
        "device": str(bench.device),
        "device_name": torch.cuda.get_device_name(bench.device) if cuda else platform.processor(),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "block_size": bs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "iters": args.iters,
        "matmul_tflops": peak / 1e12,
        "torch": torch.__version__,
        "cases": [],
    }
    print(f"bf16 matmul rate: {peak / 1e12:.1f} TFLOP/s", file=sys.stderr)
    bar = tqdm(cases, desc="prefill cases", unit="case", file=sys.stderr)
    for name, lengths in bar:
        bar.set_postfix_str(name)
        prompts = prompts_for(lengths, mc.vocab_size)
        tokens, flops = sum(lengths), model_flops(mc, lengths)
        row = {"case": name, "lengths": lengths, "tokens": tokens, "flops": flops}
        timings = {"runner": run_runner(bench, runner, prompts)}
        if not args.no_engine:
            timings["engine"] = run_engine(bench, runner, worker_cfg, prompts)
        if hf is not None:
            timings["transformers"] = run_transformers(bench, hf, prompts)
        for impl, secs in timings.items():
            row[impl] = {
                "ms": secs * 1e3,
                "tokens_per_s": tokens / secs,
                "mfu": flops / secs / peak,
            }
        if hf is not None:
            row["runner_vs_transformers"] = timings["transformers"] / timings["runner"]
        result["cases"].append(row)
        tqdm.write(
            f"{name:>6}: "
            + "  ".join(
                f"{impl} {row[impl]['tokens_per_s']:,.0f} tok/s (MFU {row[impl]['mfu']:.1%})"
                for impl in timings
            )
            + (
                f"  runner/transformers speed-up {row['runner_vs_transformers']:.2f}x"
                if hf is not None
                else ""
            ),
            file=sys.stderr,
        )
    if args.fast_out:
        base = SimpleNamespace(**globals())
        _fast().write(args, base, bench, runner, worker_cfg, hf, peak, model_dir, result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
