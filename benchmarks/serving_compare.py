"""Disaggregated vs colocated serving on the same GPUs, measured fairly, as a goodput curve.

    python benchmarks/serving_compare.py --model-dir /tmp/llama --gpus 1 \\
        --out serving_compare.json --plot serving_compare.png

Both modes get the same N GPUs (serving_placement.py: colocated = N replicas behind the router,
disaggregated = a P:D split, --pd-ratio, on one GPU both roles under MPS), the same router, the
same traffic and arrivals per point (one seed per rate and repeat), and a warm-up run after
start-up (Triton caches, CUDA graphs) before anything is measured. One `serve` per mode stays up
for the whole sweep (both at once; --modes runs one). For each rate of --rates, each repeat runs
both modes, the order alternating between repeats; past the list the rate doubles while either
mode still has >= 90 % of requests within the SLO (--no-extend stops at the list). Every point
ends with every worker's KV blocks free (checked, recorded). The JSON (--out, rewritten after
every point) has the median over repeats with its min/max spread, each mode's sustainable rate,
the comparison rows at colocated's sustainable rate and issue 33's goals (PASS/FAIL, also
printed); serving_sweep.py says how each is computed.

Splitting a sweep over several commands (each under the device's 10 minutes):
    ... --repeat-index 0 --out s.json
    ... --repeat-index 1 --resume s.json
    ... --repeat-index 2 --resume s.json --plot s.png   (or split by --rates, --modes)
--resume merges into the file and skips the points it already has (--repeat-index picks repeats;
without --no-extend a command also runs the rates past its list that the file already has).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, run as a script

from serving_placement import MODES, plan_placement  # noqa: E402
from serving_points import Traffic, point_seed, run_bench  # noqa: E402
from serving_report import load_resume, say_point, say_result  # noqa: E402
from serving_stack import ServeError, ServeStack  # noqa: E402
from serving_sweep import build_doc, merge_points, next_rate, point_key, point_metrics  # noqa: E402

DEFAULT_RATES = "4,8,16,32,48,64,96,128"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the CI test)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs each mode gets (default 1)")
    p.add_argument("--pd-ratio", metavar="P:D", help="prefill:decode GPUs (default: N//2 : rest)")
    p.add_argument("--prefill-sm-share", type=int, help="one GPU: prefill's SM %% under MPS")
    p.add_argument("--modes", default=",".join(MODES), help="which modes to run (default both)")
    p.add_argument("--rates", default=DEFAULT_RATES, help=f"req/s (default {DEFAULT_RATES})")
    p.add_argument("--no-extend", action="store_true", help="stop at the last of --rates")
    p.add_argument("--max-rate", type=float, default=1024.0, help="extension stops here")
    p.add_argument("--repeats", type=int, default=3, help="runs per point (default 3)")
    p.add_argument("--repeat-index", help="only these repeats, e.g. 0 or 1,2 (default all)")
    p.add_argument("--point-seconds", type=float, default=10.0, help="requests = rate x this")
    p.add_argument("--min-prompts", type=int, default=100, help="fewest requests per point")
    p.add_argument("--warmup-prompts", type=int, default=64, help="per mode after start-up")
    p.add_argument("--warmup-rate", type=float, default=16.0)
    p.add_argument("--request-timeout", type=float, default=60.0, help="s; later is a miss")
    p.add_argument("--workload", choices=("realistic", "mixed"), default="realistic")
    p.add_argument("--long-share", type=float, default=0.25, help="mixed: long-prompt share")
    p.add_argument("--long-len", type=int, default=3072)
    p.add_argument("--short-len", type=int, default=128)
    p.add_argument("--short-output", type=int, default=256)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=16000)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--serve-args", default="", help="more `serve` flags for both modes")
    p.add_argument("--slo", default="ttft:300,tpot:20")
    p.add_argument("--out", help="JSON, rewritten after every point")
    p.add_argument("--resume", metavar="FILE", help="merge into FILE, skip its points")
    p.add_argument("--plot", metavar="FILE.png", help="the goodput curve (needs matplotlib)")
    p.add_argument("--log-dir", help="serve logs (default: a temporary folder)")
    return p.parse_args(argv)


def _ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} wants whole numbers separated by commas, got {text!r}") from None


def check_args(args) -> dict:
    """Everything that can be wrong, before anything starts; the resolved plan."""
    from splitserve.cli.bench.workload import parse_slo

    model = Path(args.model_dir)
    if not (model / "config.json").is_file() or not any(model.glob("*.safetensors")):
        raise ValueError(
            f"--model-dir {args.model_dir}: not a checkpoint folder (config.json, *.safetensors); "
            "`splitserve make-model --preset llama-3.2-1b DIR` writes one"
        )

    try:
        rates = sorted({float(x) for x in args.rates.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--rates wants req/s separated by commas, got {args.rates!r}") from None
    if not rates or rates[0] <= 0:
        raise ValueError(f"--rates must be positive numbers, got {args.rates!r}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"--modes takes {' and/or '.join(MODES)}, got {args.modes!r}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    repeats = _ints(args.repeat_index, "--repeat-index") or list(range(args.repeats))
    if any(not 0 <= r < args.repeats for r in repeats):
        raise ValueError(f"--repeat-index must lie in 0..{args.repeats - 1}, got {repeats}")
    if args.min_prompts < 1 or args.point_seconds <= 0 or args.warmup_prompts < 0:
        raise ValueError("--min-prompts >= 1, --point-seconds > 0 and --warmup-prompts >= 0")
    try:
        parse_slo(args.slo)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    if args.plot:
        from serving_plot import require_matplotlib

        require_matplotlib()
    serve_extra = shlex.split(args.serve_args)
    serve_extra += [
        "--num-blocks",
        str(args.num_blocks),
        "--max-model-len",
        str(args.max_model_len),
    ]
    placement = plan_placement(
        args.gpus, args.pd_ratio, args.device, os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    dis = placement["disaggregated"]
    if dis["shared_gpu"] and "--mps" not in serve_extra:
        dis["serve_flags"] += [
            "--mps",
            "on",
        ]  # measured under MPS or not at all (no silent fallback)
    if args.prefill_sm_share is not None:
        placement["disaggregated"]["serve_flags"] += [
            "--prefill-sm-share",
            str(args.prefill_sm_share),
        ]
    for side in placement.values():
        side["serve_flags"] = ["--model", args.model_dir, *side["serve_flags"], *serve_extra]
    return {"rates": rates, "modes": modes, "repeats": repeats, "placement": placement}


def sweep(args, plan: dict, config: dict, out: Path | None, points, warmup, tmp: Path) -> dict:
    traffic = Traffic(args, tmp)
    log_root = Path(args.log_dir) if args.log_dir else tmp / "logs"
    stacks: dict[str, ServeStack] = {}
    doc: dict = {}

    def save() -> None:
        nonlocal doc
        doc = build_doc(config, args.gpus, plan["placement"], warmup, points)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            part = out.with_suffix(".part")
            part.write_text(json.dumps(doc, indent=2) + "\n")
            part.replace(out)

    def up(mode: str) -> ServeStack:
        """The mode's serve, started and warmed up on its first point (none when a resumed file
        has every point of that mode)."""
        if mode in stacks:
            stacks[mode].check_alive()
            return stacks[mode]
        side = plan["placement"][mode]
        print(f"[{mode}] starting serve: {shlex.join(side['serve_flags'])}", flush=True)
        stack = stacks[mode] = ServeStack.start(
            mode, side["serve_flags"], side["env"], log_root / mode
        )
        print(f"[{mode}] ready after {stack.started_s:.0f}s; warming up", flush=True)
        if args.warmup_prompts:
            seed = point_seed(args.seed + 999_983, args.warmup_rate, 0)
            t0 = time.monotonic()
            run_bench(
                stack.address, traffic.argv(args.warmup_prompts, seed), args.warmup_rate,
                args.slo, args.request_timeout, tmp / f"warmup_{mode}.json",
            )  # fmt: skip
            warmup[mode] = {
                "gpu_sharing": stack.gpu_sharing,
                "prompts": args.warmup_prompts,
                "rate": args.warmup_rate,
                "seed": seed,
                "wall_s": time.monotonic() - t0,
                "kv_free": stack.kv_free(),
            }
        return stack

    def measure(mode: str, rate: float, repeat: int, order: int) -> None:
        stack = up(mode)
        n = max(args.min_prompts, round(rate * args.point_seconds))
        seed = point_seed(args.seed, rate, repeat)
        t0 = time.monotonic()
        summary = run_bench(
            stack.address, traffic.argv(n, seed), rate, args.slo, args.request_timeout,
            tmp / f"bench_{mode}_{rate:g}_{repeat}.json",
        )  # fmt: skip
        kv = stack.kv_free()
        point = {"mode": mode, "rate": rate, "repeat": repeat, "order": order, "seed": seed}
        point |= {"num_prompts": n, "wall_s": time.monotonic() - t0, "kv_free": kv}
        point |= {"metrics": point_metrics(summary, n), "summary": summary}
        points[:] = merge_points(points, [point])
        say_point(point)
        save()
        if not all(kv.values()):
            raise ServeError(f"{mode}: KV blocks or leases still held after the point: {kv}")

    try:
        done = {point_key(p) for p in points}
        rates = list(plan["rates"])
        if not args.no_extend:  # rates an earlier command went on to (other repeats or modes)
            rates += sorted({float(p["rate"]) for p in points if p["rate"] > rates[-1]})
        i = 0
        while i < len(rates):
            rate = rates[i]
            for repeat in plan["repeats"]:
                order = plan["modes"] if (i + repeat) % 2 == 0 else plan["modes"][::-1]
                for k, mode in enumerate(order):
                    if (mode, rate, repeat) not in done:
                        measure(mode, rate, repeat, k)
            i += 1
            if i == len(rates) and not args.no_extend:
                save()
                more = next_rate(doc["sweep"], args.max_rate)
                if more is not None:
                    print(f"a mode still holds the SLO at {rate:g} req/s: extending to {more:g}")
                    rates.append(more)
        save()
        return doc
    finally:
        for mode, stack in stacks.items():
            code = stack.stop()
            print(f"[{mode}] serve stopped (exit {code})", flush=True)


def run(args) -> int:
    plan = check_args(args)
    config = {k: v for k, v in vars(args).items() if k not in ("resume", "out", "plot", "log_dir")}
    config["pd_ratio"] = "{}:{}".format(
        *(
            sum(w.startswith(role) for w in plan["placement"]["disaggregated"]["workers"])
            for role in ("prefill", "decode")
        )
    )
    config["warmed_up"] = "each mode runs --warmup-prompts unmeasured requests after start-up"
    out = Path(args.out) if args.out else Path(args.resume) if args.resume else None
    points, warmup = load_resume(args.resume, config) if args.resume else ([], {})
    with tempfile.TemporaryDirectory(prefix="serving-compare-") as d:
        doc = sweep(args, plan, config, out, points, warmup, Path(d))
    say_result(doc)
    if out is not None:
        print(f"wrote {out}")
    if args.plot:
        from serving_plot import plot_sweep

        plot_sweep(args.plot, doc)
        print(f"wrote {args.plot}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, ServeError) as exc:
        print(f"serving_compare: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("serving_compare: interrupted (the JSON has every point measured so far)")
        return 130


if __name__ == "__main__":
    sys.exit(main())
