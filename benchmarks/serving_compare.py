"""Disaggregated vs colocated serving on one machine, in one run, on a mixed workload: long
prompts arriving while many short-prompt sequences decode (the case disaggregation is for).

For each mode it starts `splitserve serve` (1 prefill + 1 decode worker, which on one GPU run
under MPS with serve's default shares; or `--colocated`: one decode worker that also prefills;
with --also-timeslice also the two workers without MPS), runs `splitserve bench` on the same JSONL workload and the
same Poisson arrivals, stops the services, and prints TTFT / ITL / TPOT p50 and p99 and goodput
at the SLO side by side with the ratios. Writes JSON (--out).

    python benchmarks/serving_compare.py --model-dir /tmp/llama --device cuda --out serving.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METRICS = [
    ("ttft_ms", "median"),
    ("ttft_ms", "p99"),
    ("itl_ms", "median"),
    ("itl_ms", "p99"),
    ("tpot_ms", "median"),
    ("tpot_ms", "p99"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--request-rate", type=float, default=16.0)
    p.add_argument("--long-share", type=float, default=0.25, help="share of long-prompt requests")
    p.add_argument("--long-len", type=int, default=3072)
    p.add_argument("--short-len", type=int, default=128)
    p.add_argument("--short-output", type=int, default=256)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=16000)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--slo", default="ttft:300,tpot:20")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--also-timeslice",
        action="store_true",
        help="also run the disaggregated mode with --mps off (the two workers time-slice the GPU)",
    )
    return p.parse_args(argv)


def write_workload(path: Path, args) -> None:
    vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(args.num_prompts):
            long = rng.random() < args.long_share
            n, out = (
                (args.long_len, args.long_output) if long else (args.short_len, args.short_output)
            )
            f.write(
                json.dumps(
                    {
                        "prompt_token_ids": [rng.randrange(10, vocab) for _ in range(n)],
                        "output_len": out,
                    }
                )
                + "\n"
            )


def run_mode(mode: str, args, workload: Path, tmp: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "splitserve.cli.main",
        "serve",
        "--model",
        args.model_dir,
        "--device",
        args.device,
        "--num-blocks",
        str(args.num_blocks),
        "--max-model-len",
        str(args.max_model_len),
        "--port",
        "0",
        "--no-http",
        "--start-timeout",
        "300",
    ] + {"colocated": ["--colocated"], "disaggregated-timeslice": ["--mps", "off"]}.get(mode, [])
    log = open(tmp / f"serve_{mode}.log", "w")  # noqa: SIM115
    serve = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 320
        while not (
            ready := re.search(
                r"^ready: router on (\S+)", (tmp / f"serve_{mode}.log").read_text(), re.M
            )
        ):
            if serve.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"serve ({mode}) did not start:\n{(tmp / f'serve_{mode}.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)
        address = ready.group(1)
        print(f"[{mode}] services ready; running the workload", flush=True)
        out = tmp / f"bench_{mode}.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "splitserve.cli.main",
                "bench",
                "--address",
                address,
                "--dataset",
                str(workload),
                "--num-prompts",
                str(args.num_prompts),
                "--request-rate",
                str(args.request_rate),
                "--slo",
                args.slo,
                "--json-out",
                str(out),
                "--no-progress",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(out.read_text())
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
        log.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        workload = tmp / "mixed.jsonl"
        write_workload(workload, args)
        modes = ["disaggregated", "colocated"]
        modes += ["disaggregated-timeslice"] if args.also_timeslice else []
        results = {mode: run_mode(mode, args, workload, tmp) for mode in modes}
    dis, col = results["disaggregated"], results["colocated"]
    print(
        f"mixed workload: {args.num_prompts} requests at {args.request_rate}/s, {args.long_share:.0%} with "
        f"{args.long_len}-token prompts ({args.long_output} out), the rest {args.short_len} in / "
        f"{args.short_output} out; SLO {args.slo}"
    )
    print(f"{'metric':14s} {'disaggregated':>14s} {'colocated':>10s} {'coloc/disagg':>13s}")
    rows = {}
    for key, stat in METRICS:
        a, b = dis[key][stat], col[key][stat]
        rows[f"{key}_{stat}"] = dict(disaggregated=a, colocated=b, ratio=b / a if a else None)
        print(f"{key + ' ' + stat:14s} {a:14.2f} {b:10.2f} {b / a if a else float('nan'):12.2f}x")
    for key in ("goodput", "request_throughput", "output_throughput"):
        a, b = dis[key], col[key]
        rows[key] = dict(disaggregated=a, colocated=b, ratio=b / a if a else None)
        print(f"{key:14s} {a:14.2f} {b:10.2f} {b / a if a else float('nan'):12.2f}x")
    if "disaggregated-timeslice" in results:  # --mps off: what one GPU gives without MPS
        ts = results["disaggregated-timeslice"]
        for key, stat in METRICS:
            rows[f"{key}_{stat}"]["disaggregated_timeslice"] = ts[key][stat]
            print(f"{key + ' ' + stat:14s} time-sliced disaggregated {ts[key][stat]:10.2f}")
        rows["goodput"]["disaggregated_timeslice"] = ts["goodput"]
        print(f"goodput        time-sliced disaggregated {ts['goodput']:10.2f}")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"config": vars(args), "rows": rows, "raw": results}, indent=2)
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
