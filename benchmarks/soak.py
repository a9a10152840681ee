"""Bounded soak on loopback: N requests at concurrency C through a real router over 2 prefill
and 2 decode worker processes, a share of them cancelled by the client mid-stream, a share
aborted by id (the Abort RPC), bursts of 2C requests at once, and k processes SIGKILLed (in turn
a decode worker, a prefill worker, the router) and restarted on the same port during the run.

Prints succeeded / failed by status / cancelled / lost (must be 0) / duplicated (must be 0),
per kill the detection time (kill -> the router shows the worker unhealthy) and the recovery
time (restart -> healthy again in the router), leaked KV blocks and leases at the end (must be
0) and the RSS drift of the processes that ran the whole time. Exits 1 when lost, duplicated or
leaked is not 0, so it can gate a release; on any failure the tail of every service's log is
printed (the logs are kept in --log-dir when given).

    python benchmarks/soak.py --requests 300 --concurrency 16 --cancel-share 0.1 --kills 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault(
    "GRPC_VERBOSITY", "ERROR"
)  # before grpc loads: no fork-handler notes per restart
from soak_checks import LEASE_TTL_S, SoakFailure, leaks, rss_mb, wait_health  # noqa: E402
from soak_requests import Ledger, one_request  # noqa: E402

from splitserve.cli.launcher import Launcher, StartError  # noqa: E402
from splitserve.protos import generate_pb2_grpc  # noqa: E402
from splitserve.service.tls import open_channel  # noqa: E402

WORKER_FLAGS = [
    "--device",
    "cpu",
    "--num-blocks",
    "256",
    "--block-size",
    "16",
    "--max-model-len",
    "512",
]
SERVICES = {
    "prefill-worker": "splitserve.v1.PrefillWorker",
    "decode-worker": "splitserve.v1.DecodeWorker",
    "router": "splitserve.v1.GenerateService",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-dir",
        help="checkpoint folder (default: the embedded tiny model, made in a temp dir)",
    )
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--cancel-share", type=float, default=0.1, help="share of requests the client cancels"
    )
    p.add_argument(
        "--abort-share", type=float, default=0.0, help="share of requests aborted by id (Abort RPC)"
    )
    p.add_argument(
        "--bursts", type=int, default=0, help="times 2 x concurrency requests start at once"
    )
    p.add_argument(
        "--kills",
        type=int,
        default=2,
        help="processes SIGKILLed (and restarted) during the run: in "
        "turn a decode worker, a prefill worker, the router",
    )
    p.add_argument(
        "--log-dir", help="keep the services' logs here (default: a temp dir, removed at the end)"
    )
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", help="write the summary as JSON here")
    return p.parse_args(argv)


async def kill_and_restart(launcher: Launcher, child, stub, router) -> dict:
    child.proc.kill()
    child.proc.wait()
    if child is router:  # nobody to watch it: back once its own health says SERVING
        start = time.monotonic()
        launcher.launch(child)
        await asyncio.to_thread(launcher.wait_healthy, 120)
        took = round(time.monotonic() - start, 3)
        return {
            "worker": child.name,
            "detect_s": 0.0,
            "recover_s": took,
            "restart_to_serving_s": took,
        }
    detect = await wait_health(stub, child, False)
    start = time.monotonic()
    launcher.launch(child)
    recover = await wait_health(stub, child, True)
    return {
        "worker": child.name,
        "detect_s": round(detect, 3),
        "recover_s": round(recover, 3),
        "restart_to_serving_s": round(time.monotonic() - start, 3),
    }


async def drive(args, launcher: Launcher, router, workers, vocab: int) -> dict:
    rng = random.Random(args.seed)
    ledger = Ledger()
    kill_at = {round(args.requests * (i + 1) / (args.kills + 1)) for i in range(args.kills)}
    burst_at = {round(args.requests * (i + 0.5) / (args.bursts + 0.5)) for i in range(args.bursts)}
    victims = [
        workers[2],
        workers[0],
        router,
        workers[3],
        workers[1],
    ]  # decode, prefill, router, ...
    kills: list[dict] = []
    burst_members: set[int] = set()  # requests started as part of a burst (not a new one)
    rss0 = {c.name: rss_mb(c.pid) for c in (router, *workers)}
    async with open_channel(router.address, router.tls) as ch:
        stub = generate_pb2_grpc.GenerateServiceStub(ch)
        sem, tasks, t0 = asyncio.Semaphore(args.concurrency), [], time.monotonic()

        async def run_one(i: int, gate=sem) -> None:
            async with gate:
                prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(4, 120))]
                cancel = (
                    rng.randint(1, args.max_tokens - 1)
                    if rng.random() < args.cancel_share
                    else None
                )
                abort = (
                    rng.randint(1, args.max_tokens - 1) if rng.random() < args.abort_share else None
                )
                await one_request(stub, ledger, f"soak-{i}", prompt, args.max_tokens, cancel, abort)
                done = sum(bool(o) for o in ledger.outcomes.values())
                if done % 50 == 0:
                    print(f"  {done}/{args.requests} requests done", flush=True)

        for i in range(args.requests):
            burst = (
                i in burst_at
            )  # this one and the next 2C-1 start at once, past the concurrency gate
            tasks.append(
                asyncio.create_task(run_one(i, asyncio.Semaphore(10**6) if burst else sem))
            )
            if i in kill_at:
                victim = victims[len(kills) % len(victims)]
                print(f"  killing {victim.name} ({victim.address})", flush=True)
                kills.append(await kill_and_restart(launcher, victim, stub, router))
            if burst and i not in burst_members:
                ledger.bursts += 1
                print(f"  burst of {2 * args.concurrency} requests", flush=True)
                burst_members |= set(range(i + 1, i + 2 * args.concurrency))
                burst_at |= burst_members
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
    killed = {k["worker"] for k in kills}
    drift = {
        n: round(rss_mb(c.pid) - rss0[n], 1)
        for n, c in ((c.name, c) for c in (router, *workers))
        if n not in killed
    }
    return {
        **ledger.summary(),
        "elapsed_s": round(elapsed, 2),
        "kills": kills,
        "kv_at_end": await leaks(workers),
        "rss_drift_mb": drift,
    }


def print_log_tails(launcher: Launcher, lines: int = 40) -> None:
    for child in launcher.children:
        print(f"--- last {lines} lines of {child.log_path} ---", flush=True)
        try:
            print(
                "\n".join(child.log_path.read_text(errors="replace").splitlines()[-lines:]),
                flush=True,
            )
        except OSError as exc:
            print(f"(unreadable: {exc})", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="splitserve-soak-") as tmp:
        model = args.model_dir or f"{tmp}/tiny"
        if not args.model_dir:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "splitserve.cli.main",
                    "make-model",
                    "--preset",
                    "tiny",
                    model,
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp) / "logs"
        # a keyless loopback router: GetServerInfo shows worker addresses (soak_checks.py reads
        # them) and Abort finds the soak's requests; keys in the caller's environment would not
        no_keys = {"SPLITSERVE_API_KEYS": "", "SPLITSERVE_ADMIN_KEYS": ""}
        launcher = Launcher(log_dir, on_event=lambda m: print(f"  {m}", flush=True), env=no_keys)
        flags = ["--model", model, *WORKER_FLAGS]
        role_flags = {
            "prefill-worker": [*flags, "--lease-ttl-s", str(LEASE_TTL_S)],
            "decode-worker": flags,
        }
        workers = [
            launcher.add(f"{role}-{i}", role, role_flags[role], SERVICES[role])
            for role in ("prefill-worker", "decode-worker")
            for i in range(2)
        ]
        router = launcher.add(
            "router",
            "router",
            lambda: [
                "--model",
                model,
                "--max-model-len",
                "512",
                "--poll-interval-s",
                "0.1",
                *[f for w in workers for f in (f"--{w.subcommand.split('-')[0]}", w.address)],
            ],
            SERVICES["router"],
        )
        try:
            launcher.start_all()
            launcher.wait_healthy(300)
            print(
                f"soak: {args.requests} requests, concurrency {args.concurrency}, {args.cancel_share:.0%} "
                f"cancelled, {args.abort_share:.0%} aborted, {args.bursts} bursts, {args.kills} kills",
                flush=True,
            )
            summary = asyncio.run(drive(args, launcher, router, workers, vocab))
            return report(args, summary, launcher)
        except (SoakFailure, StartError) as exc:
            print(f"soak: {exc}", flush=True)
            print_log_tails(launcher)
            return 1
        except BaseException:  # anything else: the services' side of the story, then the traceback
            print_log_tails(launcher)
            raise
        finally:
            launcher.stop(grace_s=10)


def report(args, summary: dict, launcher: Launcher) -> int:
    print(json.dumps(summary, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    leaked = sum(
        v["leaked_blocks"] + v["leases"] + v["running"] for v in summary["kv_at_end"].values()
    )
    bad = summary["lost"] or summary["duplicated"] or leaked
    print(
        f"soak: lost {summary['lost']}, duplicated {summary['duplicated']}, leaked {leaked} -> "
        f"{'FAIL' if bad else 'ok'}"
    )
    if bad:
        print_log_tails(launcher)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
