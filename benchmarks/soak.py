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
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault(
    "GRPC_VERBOSITY", "ERROR"
)  # before grpc loads: no fork-handler notes per restart
import grpc  # noqa: E402

from splitserve.cli.launcher import Launcher, StartError  # noqa: E402
from splitserve.protos import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

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
# a killed router leaves the leases of its in-flight requests to expire on the prefill workers
# (nothing else can release them): short, so the end-of-run check can wait them out
LEASE_TTL_S = 5.0
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


class Ledger:
    """Request id -> terminal outcomes; a request with none is lost, with two is duplicated."""

    def __init__(self) -> None:
        self.outcomes: dict[str, list[str]] = {}

    def start(self, rid: str) -> None:
        self.outcomes[rid] = []

    def end(self, rid: str, outcome: str) -> None:
        self.outcomes[rid].append(outcome)

    def summary(self) -> dict:
        ends = Counter(o[0] for o in self.outcomes.values() if len(o) == 1)
        return {
            "requests": len(self.outcomes),
            "succeeded": ends.pop("OK", 0),
            "cancelled": ends.pop("CANCELLED", 0),
            "failed_by_status": dict(ends),
            "lost": sum(not o for o in self.outcomes.values()),
            "duplicated": sum(len(o) > 1 for o in self.outcomes.values()),
        }


async def one_request(
    stub,
    ledger: Ledger,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    cancel_after: int | None,
    abort_after: int | None = None,
):
    ledger.start(rid)
    req = generate_pb2.GenerateRequest(
        request_id=rid,
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        ),
    )
    call = stub.Generate(req, timeout=60)
    tokens, finished = 0, 0
    try:
        async for chunk in call:
            tokens += len(chunk.token_ids)
            finished += chunk.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
            if cancel_after is not None and tokens >= cancel_after and not finished:
                call.cancel()
                ledger.end(rid, "CANCELLED")
                return
            if abort_after is not None and tokens >= abort_after and not finished:
                abort_after = None  # once; the stream then ends with its own last chunk (ABORT)
                await stub.Abort(generate_pb2.AbortRequest(request_id=rid), timeout=10)
        # a finished stream carries exactly one final chunk; each extra one counts as a duplicate
        for _ in range(finished):
            ledger.end(rid, "OK")
        if not finished:
            ledger.end(rid, "NO_FINAL_CHUNK")  # the stream ended cleanly without saying why
    except grpc.aio.AioRpcError as err:
        ledger.end(rid, err.code().name)
    except Exception as exc:  # anything else leaves the request without an outcome: counted lost
        print(f"  {rid}: client error {type(exc).__name__}: {exc}", flush=True)


async def worker_health(stub) -> dict[str, bool]:
    info = await stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)
    return {w.address: w.healthy for w in info.workers}


class SoakFailure(RuntimeError):
    """The soak could not go on (a restarted process never came back, ...): one line."""


async def wait_health(stub, child, healthy: bool, timeout: float = 120.0) -> float:
    start = time.monotonic()
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):  # the router itself may be restarting
            if (await worker_health(stub)).get(child.address) == healthy:
                return time.monotonic() - start
        if healthy and not child.alive():
            raise SoakFailure(f"{child.name} exited with {child.proc.returncode} after its restart")
        if time.monotonic() - start > timeout:
            raise SoakFailure(
                f"{child.address} ({child.name}) not {'healthy' if healthy else 'evicted'} in the "
                f"router within {timeout:.0f}s"
            )
        await asyncio.sleep(0.02)


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


async def leaks(children) -> dict[str, dict]:
    out = {}
    for c in children:
        stub_cls = (
            worker_pb2_grpc.PrefillWorkerStub
            if c.subcommand == "prefill-worker"
            else worker_pb2_grpc.DecodeWorkerStub
        )
        async with grpc.aio.insecure_channel(c.address) as ch:
            for _ in range(
                int((LEASE_TTL_S + 10) * 10)
            ):  # releases are asynchronous, orphaned leases expire
                ld = await stub_cls(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
                if ld.free_blocks == ld.total_blocks and not (
                    ld.leases_held or ld.num_running or ld.num_waiting
                ):
                    break
                await asyncio.sleep(0.1)
        out[c.name] = {
            "leaked_blocks": ld.total_blocks - ld.free_blocks,
            "leases": ld.leases_held,
            "running": ld.num_running + ld.num_waiting,
        }
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


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
    rss0 = {c.name: rss_mb(c.pid) for c in (router, *workers)}
    async with grpc.aio.insecure_channel(router.address) as ch:
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
            if burst:
                print(f"  burst of {2 * args.concurrency} requests", flush=True)
                burst_at |= set(range(i + 1, i + 2 * args.concurrency))
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
        launcher = Launcher(log_dir, on_event=lambda m: print(f"  {m}", flush=True))
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
