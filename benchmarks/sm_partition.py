"""One GPU shared by prefill and decode: how much each load slows the other when they run
together, under time-slicing (two processes, as two workers without MPS), MPS with SM shares
(two processes, as `serve` runs them), and CUDA green contexts (one process, an SM partition
per load) — the measurement issue 33 asks for before choosing MPS or green contexts.

    python benchmarks/sm_partition.py --model-dir /tmp/l1b --prefill-shares 30,50 \\
        --out sm_partition.json
    python benchmarks/sm_partition.py --preset tiny --device cpu --seconds 1 --modes alone,timeslice  # smoke

Each mode runs the decode loop (CUDA-graph replay of a --batch x --context decode step) and
the prefill loop (one --prompt-len prompt after another) together for --seconds; `alone` runs
each by itself. Rows: decode step p50 / p99 ms and steps/s, prefill ms per prompt and
prompts/s, and `overlap` = decode rate / its rate alone + prefill rate / its rate alone (1.0:
no better than taking turns; 2.0: neither slows the other). Green contexts also time each load
alone in its partition, which shows whether the partition took effect.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("alone", "timeslice", "mps", "green")
READY_TIMEOUT_S = 900.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--model-dir", default=None, help="written from --preset when it has none")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64, help="decode batch")
    p.add_argument("--context", type=int, default=1024, help="decode context tokens")
    p.add_argument("--prompt-len", type=int, default=3072)
    p.add_argument("--seconds", type=float, default=8.0, help="per mode")
    p.add_argument("--prefill-shares", default="30", help="prefill SM percent(s), e.g. 30,50")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default=None)
    # one load in this process (the script starts itself this way)
    p.add_argument("--role", choices=["decode", "prefill", "green"], help=argparse.SUPPRESS)
    p.add_argument("--sync-dir", help=argparse.SUPPRESS)
    p.add_argument("--share", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = set(args.modes.split(",")) - set(MODES)
    if bad:
        p.error(f"--modes: unknown {', '.join(sorted(bad))}; choose from {', '.join(MODES)}")
    args.shares = [int(x) for x in args.prefill_shares.split(",") if x.strip()]
    if not args.shares or any(not 1 <= s <= 99 for s in args.shares):
        p.error(f"--prefill-shares wants percents from 1 to 99, got {args.prefill_shares!r}")
    return args


def _stats(times: list[float], seconds: float) -> dict:
    if not times:
        return {"iterations": 0}
    q = statistics.quantiles(times, n=100) if len(times) > 1 else [times[0]] * 99
    return {
        "iterations": len(times),
        "p50_ms": statistics.median(times),
        "p99_ms": q[98],
        "per_s": len(times) / seconds,
    }


# ---- one process, one or two loads ------------------------------------------------------------
def _build(role: str, args):
    sys.path.insert(0, str(HERE))
    from sm_partition_roles import DecodeLoop, PrefillLoop

    if role == "decode":
        return DecodeLoop(args.model_dir, args.device, args.batch, args.context)
    return PrefillLoop(args.model_dir, args.device, args.prompt_len)


def _wait_go(sync: Path, name: str) -> None:
    (sync / f"{name}.ready").touch()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (sync / "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: no go signal within {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.005)


def role_main(args) -> int:
    from sm_partition_green import run_green

    sync = Path(args.sync_dir)
    if args.role == "green":
        loops = {r: _build(r, args) for r in ("decode", "prefill")}
        result = run_green(loops, args.share, args.seconds, lambda: _wait_go(sync, "green"))
    else:
        sys.path.insert(0, str(HERE))
        from sm_partition_roles import run_for

        loop = _build(args.role, args)
        _wait_go(sync, args.role)
        result = {args.role: run_for(loop, args.seconds)}
    (sync / f"{args.role}.json").write_text(json.dumps(result))
    return 0


# ---- the orchestrator ---------------------------------------------------------------------------
def _launch(args, roles: list[str], env_of, share: int = 0) -> dict[str, list[float]]:
    """Starts one process per role, waits until all are built, lets them go together."""
    with tempfile.TemporaryDirectory(prefix="smpart-") as d:
        sync = Path(d)
        procs = []
        for role in roles:
            cmd = [sys.executable, __file__, "--role", role, "--sync-dir", d, "--share", str(share)]
            cmd += [f"--{k.replace('_', '-')}={v}" for k, v in _passed(args).items()]
            env = {**os.environ, **env_of(role)}
            procs.append(subprocess.Popen(cmd, env=env))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all((sync / f"{r}.ready").exists() for r in roles):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a {'/'.join(roles)} process failed or did not get ready")
            time.sleep(0.05)
        (sync / "go").touch()
        for p in procs:
            if p.wait(args.seconds * 4 + 300) != 0:
                raise SystemExit(f"a {'/'.join(roles)} process exited {p.returncode}")
        out: dict[str, list[float]] = {}
        for role in roles:
            out.update(json.loads((sync / f"{role}.json").read_text()))
        return out


def _passed(args) -> dict:
    keys = ("model_dir", "device", "batch", "context", "prompt_len", "seconds")
    return {k: getattr(args, k) for k in keys}


def _row(mode: str, share: int | None, times: dict, alone: dict, seconds: float) -> dict:
    row = {"mode": mode, "prefill_share": share}
    for role in ("decode", "prefill"):
        row[role] = _stats(times.get(role, []), seconds)
        if f"{role}_alone" in times:  # green: the load alone in its partition
            row[f"{role}_alone_in_partition"] = _stats(times[f"{role}_alone"], seconds)
    if "sms" in times:  # green: the partition sizes, prefill and decode
        row["sms"] = times["sms"]
    if alone and mode != "alone":
        row["overlap"] = sum(
            row[r].get("per_s", 0) / alone[r]["per_s"] for r in ("decode", "prefill")
        )
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role:
        return role_main(args)
    from splitserve.cli.make_model import make_model

    root = Path(os.environ.get("SPLITSERVE_CACHE", Path(tempfile.gettempdir()) / "splitserve"))
    args.model_dir = str(args.model_dir or root / "models" / args.preset)
    if not (Path(args.model_dir) / "config.json").is_file():
        print(f"writing the {args.preset} checkpoint to {args.model_dir} ...", file=sys.stderr)
        make_model(args.preset, Path(args.model_dir))
    modes = args.modes.split(",")
    rows, alone = _Rows(args), {}
    no_env = lambda role: {}  # noqa: E731
    print("[alone] decode, then prefill, each by itself", file=sys.stderr, flush=True)
    for role in ("decode", "prefill"):
        alone[role] = _stats(_launch(args, [role], no_env)[role], args.seconds)
    if "alone" in modes:
        rows.append({"mode": "alone", "prefill_share": None, **alone})
    if "timeslice" in modes:
        print("[timeslice] two processes, no MPS", file=sys.stderr, flush=True)
        rows.append(
            _row(
                "timeslice", None, _launch(args, ["decode", "prefill"], no_env), alone, args.seconds
            )
        )
    for share in args.shares:
        if "mps" in modes:
            rows.append(_mps_row(args, share, alone))
        if "green" in modes:
            print(f"[green {share}%] one process, two partitions", file=sys.stderr, flush=True)
            times = _launch(args, ["green"], no_env, share)
            rows.append(_row("green", share, times, alone, args.seconds))
    for row in rows:
        if "skipped" in row:
            continue
        d, pf = row["decode"], row["prefill"]
        print(
            f"{row['mode']:>9} {row['prefill_share'] or '':>3}  decode p50/p99 "
            f"{d.get('p50_ms', 0):7.2f}/{d.get('p99_ms', 0):7.2f} ms  prefill "
            f"{pf.get('p50_ms', 0):8.2f} ms  overlap {row.get('overlap', 1.0):.2f}"
        )
    if args.out:
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


class _Rows(list):
    """The rows so far, rewritten to --out after each mode: a later mode that fails (a missing
    MPS, a driver without green contexts) keeps what was measured."""

    def __init__(self, args) -> None:
        super().__init__()
        self.args = args

    def append(self, row: dict) -> None:
        super().append(row)
        if self.args.out:
            config = {k: v for k, v in vars(self.args).items() if k != "role"}
            Path(self.args.out).write_text(
                json.dumps({"config": config, "rows": list(self)}, indent=2)
            )


def _mps_row(args, share: int, alone: dict) -> dict:
    import shutil

    from splitserve.cli.serve_mps import CONTROL, MpsPlan

    if shutil.which(CONTROL) is None:
        print(f"[mps] {CONTROL} not found: skipped", file=sys.stderr)
        return {"mode": "mps", "prefill_share": share, "skipped": f"{CONTROL} not found"}
    total = subprocess.run(  # in a child: this process must not hold a CUDA context under MPS
        [
            sys.executable,
            "-c",
            "import torch; print(torch.cuda.get_device_properties(0).total_memory)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    plan = MpsPlan(0, int(total.stdout.split()[-1]), share, 50)
    plan.start(lambda line: print(f"[mps {share}%] {line}", file=sys.stderr, flush=True))
    try:
        times = _launch(args, ["decode", "prefill"], plan.env)
    finally:
        plan.stop()
    return _row("mps", share, times, alone, args.seconds)


if __name__ == "__main__":
    sys.exit(main())
