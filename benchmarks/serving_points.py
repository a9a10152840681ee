"""One measured point of serving_compare.py: `splitserve bench` against a running serve.

    Traffic(args, tmp).argv(n, seed)  bench flags giving the same prompts for the same (n, seed)
    run_bench(address, traffic, ...)  one bench run -> its --json-out summary (per-request rows
                                      dropped: the sweep keeps summaries)
    point_seed(base, rate, repeat)    the seed of a point: the same for both modes, a new one per
                                      rate and repeat (prompts never repeat across points, so no
                                      prefix cache carries one point's prompts into the next)

Workloads: `realistic` is bench's own (`--traffic realistic`: chat and coding shaped lengths,
per-request sampling parameters); `mixed` is the synthetic one of the first comparison (a share
of long prompts with short outputs among short prompts with long outputs, greedy), written as a
JSONL per (n, seed).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

BENCH = [sys.executable, "-m", "splitserve.cli.main", "bench"]


def point_seed(base: int, rate: float, repeat: int) -> int:
    return base + 100_003 * repeat + int(round(rate * 100))


class Traffic:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.vocab = None

    def _mixed_file(self, n: int, seed: int) -> Path:
        a = self.args
        path = self.tmp / f"mixed_{n}_{seed}.jsonl"
        if path.exists():  # the other mode's run of the same point
            return path
        if self.vocab is None:
            self.vocab = json.loads((Path(a.model_dir) / "config.json").read_text())["vocab_size"]
        rng = random.Random(seed)
        with open(path, "w") as f:
            for _ in range(n):
                long = rng.random() < a.long_share
                length, out = (a.long_len, a.long_output) if long else (a.short_len, a.short_output)
                ids = [rng.randrange(10, self.vocab) for _ in range(length)]
                f.write(json.dumps({"prompt_token_ids": ids, "output_len": out}) + "\n")
        return path

    def argv(self, n: int, seed: int) -> list[str]:
        if self.args.workload == "realistic":
            return ["--traffic", "realistic", "--num-prompts", str(n), "--seed", str(seed)]
        return [
            "--dataset",
            str(self._mixed_file(n, seed)),
            "--num-prompts",
            str(n),
            "--seed",
            str(seed),
        ]


def run_bench(
    address: str,
    traffic_argv: list[str],
    rate: float,
    slo: str,
    request_timeout_s: float,
    json_out: Path,
) -> dict:
    """bench's summary; ValueError with its last lines when it wrote none (a run where every
    request failed still has a summary: those are misses, not an error of the script)."""
    cmd = [*BENCH, "--address", address, *traffic_argv, "--request-rate", f"{rate:g}"]
    cmd += ["--slo", slo, "--timeout", f"{request_timeout_s:g}", "--json-out", str(json_out)]
    done = subprocess.run([*cmd, "--no-progress"], capture_output=True, text=True)
    if done.returncode not in (0, 1) or not json_out.exists():
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise ValueError(f"splitserve bench failed (exit {done.returncode}):\n{tail}")
    doc = json.loads(json_out.read_text())
    doc.pop("requests", None)
    return doc
