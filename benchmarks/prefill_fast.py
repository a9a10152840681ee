"""Issue 31's prefill table (`prefill_fast.json`), written by `benchmarks/prefill.py --fast-out`.

Rows 1x128, 1x1024, 8x1024 (packed in one step) and 1x8192 tokens: ms through the PrefillEngine
as a request meets it (warm-up on, prefix cache off; `ms` greedy, `sampled_ms` with the first
token sampled at temperature 1, the OpenAI default), MFU against the bf16 matmul rate measured
in the same run, and the ratio to `transformers` SDPA. Then the first-prompt stall: a real
prefill worker process started with an empty TRITON_CACHE_DIR; the TTFT (Prefill RPC latency)
of the first `--first-prompt-len`-token prompt after SERVING divided by the median of the next
ten (distinct prompts, so no prefix-cache hit), with the worker's start-up time and its
`splitserve_kernel_compilations_total` while serving; the worker rehearses at start-up
(`--rehearsal`, prefill_worker/rehearsal.py: `rehearsal_requests_ms`), and a second worker
without it (`no_rehearsal`) shows what the rehearsal takes away.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

GC_MAX_PAUSE = re.compile(r'splitserve_gc_pause_max_seconds\{generation="(\d)"\} ([\d.e+-]+)')
SERVING_LINE = re.compile(
    r"serving splitserve\.v1\.PrefillWorker on ([\w.]+):(\d+).*metrics on :(\d+)"
    r".*started in ([\d.]+) s"
)
STEP_SUMS = {  # the worker's step time as the event loop sees it, and as its step thread does
    k: re.compile(rf"splitserve_prefill_{k}_seconds_(sum|count) ([\d.e+-]+)")
    for k in ("step", "step_thread")
}
REHEARSAL_LINE = re.compile(r"rehearsed (\d+) requests of (\d+)-(\d+) tokens in ([\d.]+) ms")
SERVING_COMPILES = re.compile(r'splitserve_kernel_compilations_total\{phase="serving"\} ([\d.]+)')


def add_arguments(p) -> None:
    p.add_argument("--fast-out", default=None, help="also write issue 31's table here")
    p.add_argument("--fast-cases", default="1x128,1x1024,8x1024,1x8192")
    p.add_argument("--first-prompt-len", type=int, default=3072, help="0: no first-prompt workers")
    p.add_argument(
        "--dense-min-tokens",
        type=int,
        default=None,
        help="smallest bucket whose fresh single prompts run dense (cuDNN) attention, in the "
        "table's engine and the first-prompt workers (engine/prefill_dense.py; default 2048); "
        "the table at the default runs first, beside it (default_results)",
    )


def parse_cases(text: str) -> list[tuple[str, list[int]]]:
    """'1x128,8x1024' -> [('1x128', [128]), ('8x1024', [1024] * 8)]."""
    out = []
    for case in filter(None, (c.strip() for c in text.split(","))):
        n, length = case.split("x")
        out.append((case, [int(length)] * int(n)))
    return out


def table(base, bench, runner, worker_cfg, hf, peak: float, cases) -> list[dict]:
    rows = []
    for name, lengths in cases:
        prompts = base.prompts_for(lengths, runner.model_config.vocab_size)
        flops = base.model_flops(runner.model_config, lengths)
        secs = base.run_engine(bench, runner, worker_cfg, prompts)
        row = {"case": name, "ms": secs * 1e3, "mfu": flops / secs / peak}
        # what an OpenAI client's request meets: its first token sampled at temperature 1
        row["sampled_ms"] = base.run_engine(bench, runner, worker_cfg, prompts, sampled=True) * 1e3
        if hf is not None:
            row["transformers_ms"] = base.run_transformers(bench, hf, prompts) * 1e3
            row["ratio_to_transformers"] = row["transformers_ms"] / row["ms"]
        print(
            f"fast {name:>7}: {row['ms']:.3f} ms (sampled {row['sampled_ms']:.3f} ms), "
            f"MFU {row['mfu']:.1%}",
            file=sys.stderr,
        )
        rows.append(row)
    return rows


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


IDLE_PAUSE_S = 2.0


def first_prompt(
    model_dir,
    device: str,
    length: int,
    vocab: int,
    block_size: int,
    budget: int,
    follow: int = 10,
    rehearsal: bool = True,
) -> dict:
    """Starts a prefill worker with a cold Triton cache and times its first prompts
    (`rehearsal`: the worker's start-up rehearsal on or off, prefill_worker/rehearsal.py)."""
    import grpc

    from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc
    from splitserve.worker.gc_pauses import FREEZE_OFF_ENV

    cache = tempfile.mkdtemp(prefix="triton-cold-")
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    cmd = [
        sys.executable, "-m", "splitserve.cli.main", "prefill-worker", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", device,
        "--block-size", str(block_size), "--max-num-batched-tokens", str(budget),
        "--max-model-len", str(length + 16), "--rehearsal" if rehearsal else "--no-rehearsal",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        while True:
            line = lines.get(timeout=600)
            if line is None:
                raise RuntimeError("prefill worker exited before SERVING:\n" + "".join(seen))
            seen.append(line)
            if m := SERVING_LINE.search(line):
                break
        address, metrics_port, startup_s = f"{m[1]}:{m[2]}", int(m[3]), float(m[4])
        rehearsed = next(filter(None, map(REHEARSAL_LINE.search, seen)), None)
        params = generate_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        ttfts, parts = [], []
        with grpc.insecure_channel(address) as channel:
            # connected first, as a router's channel is (its health checks): the first prompt's
            # time is the worker's, not the TCP + HTTP/2 handshake's
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            for i in range(2 + follow):
                if i == 1 + follow:  # one more after an idle pause: a once-only cost, or idling?
                    before_idle = _step_sums(_scrape(metrics_port))
                    time.sleep(IDLE_PAUSE_S)
                prompt = [(7919 * (i + 11) + 104729 * j) % (vocab - 3) + 3 for j in range(length)]
                req = worker_pb2.PrefillRequest(
                    request_id=f"first-{i}", prompt_token_ids=prompt, sampling=params
                )
                start = time.perf_counter()
                resp = stub.Prefill(req, timeout=600)
                ttfts.append(time.perf_counter() - start)
                # the worker's own split: waiting for a step, and the steps + sampling
                parts.append((resp.queue_time_ms, resp.compute_time_ms, resp.sampling_time_ms))
                stub.ReleaseLease(
                    worker_pb2.ReleaseLeaseRequest(
                        lease_id=resp.kv.lease_id, request_id=req.request_id
                    ),
                    timeout=30,
                )
                if i == 0:
                    after_first = _step_sums(_scrape(metrics_port))
        scraped = _scrape(metrics_port)
        compiles = SERVING_COMPILES.search(scraped)
        gc_max = GC_MAX_PAUSE.findall(scraped)
    finally:
        stop_worker(proc)
    after_idle, idle_parts = ttfts.pop(), parts.pop()
    rest = statistics.median(ttfts[1:])
    print(
        f"first {length}-token prompt after SERVING (cold Triton cache): {ttfts[0] * 1e3:.1f} ms, "
        f"median of the next {follow} {rest * 1e3:.1f} ms, start-up {startup_s:.1f} s",
        file=sys.stderr,
    )
    return {
        "first_prompt_ratio": ttfts[0] / rest,
        "rehearsal": rehearsal,
        # the rehearsal's cost at start-up (part of startup_s): [requests, ms]
        "rehearsal_requests_ms": [int(rehearsed[1]), float(rehearsed[4])] if rehearsed else None,
        "first_prompt_ms": ttfts[0] * 1e3,
        "next_median_ms": rest * 1e3,
        "first_prompt_len": length,
        # [queue, compute, sampling] ms the worker reported: the first prompt, then the next ones'
        # medians; what the worker does not report is the RPC and the servicer around it
        "first_prompt_worker_ms": list(parts[0]),
        "next_worker_median_ms": [statistics.median(p[k] for p in parts[1:]) for k in range(3)],
        # the same prompt length after the worker idled IDLE_PAUSE_S: if it pays like the first,
        # the first prompt's extra is the idle GPU / CPU waking up, not a missed warm-up
        "after_idle_ms": after_idle * 1e3,
        "after_idle_worker_ms": list(idle_parts),
        "startup_s": startup_s,
        "serving_compilations": float(compiles[1]) if compiles else None,
        # per step: the first prompt's mean, then the next prompts' (before the idle pause):
        # the loop's wall of a step and its step thread's; compute time minus the loop's wall
        # is admission and finishing, the loop's minus the thread's is the hop between them
        "step_ms_first_then_rest": _first_and_rest(after_first, before_idle, "step"),
        "step_thread_ms_first_then_rest": _first_and_rest(after_first, before_idle, "step_thread"),
        # the worker's longest Python garbage collection by generation (worker/gc_pauses.py)
        "gc_pause_max_ms": {g: float(v) * 1e3 for g, v in gc_max},
        "gc_heap_frozen": os.environ.get(FREEZE_OFF_ENV) != "1",
    }


def stop_worker(proc: subprocess.Popen) -> None:
    """SIGTERM (the worker's drain), then a kill after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def _step_sums(scraped: str) -> dict[str, dict[str, float]]:
    return {k: {m[0]: float(m[1]) for m in rx.findall(scraped)} for k, rx in STEP_SUMS.items()}


def _first_and_rest(first: dict, end: dict, key: str) -> list[float] | None:
    """[mean ms of the first prompt's steps, of the later steps] (None: not exported)."""
    a, b = first.get(key, {}), end.get(key, {})
    if not {"sum", "count"} <= a.keys() or not {"sum", "count"} <= b.keys():
        return None
    later = max(b["count"] - a["count"], 1)
    return [a["sum"] * 1e3 / max(a["count"], 1), (b["sum"] - a["sum"]) * 1e3 / later]


def write(args, base, bench, runner, worker_cfg, hf, peak, model_dir, result) -> None:
    from splitserve.engine import prefill_dense

    cfg = worker_cfg.model_copy(update={"warmup": True})  # as a request meets a serving worker
    fast = {k: result[k] for k in ("preset", "device_name", "dtype", "matmul_tflops", "torch")}
    cases = parse_cases(args.fast_cases)
    if args.dense_min_tokens:  # the default's table first, beside it in the same run
        fast["default_dense_min_tokens"] = prefill_dense.DENSE_MIN_TOKENS
        fast["default_results"] = table(base, bench, runner, cfg, hf, peak, cases)
        # here (read at each engine's capture) and in the first-prompt workers
        prefill_dense.DENSE_MIN_TOKENS = args.dense_min_tokens
        os.environ["SPLITSERVE_DENSE_MIN_TOKENS"] = str(args.dense_min_tokens)
    fast["dense_min_tokens"] = prefill_dense.DENSE_MIN_TOKENS
    fast["results"] = table(base, bench, runner, cfg, hf, peak, cases)
    bs, budget, length = args.block_size, args.max_num_batched_tokens, args.first_prompt_len
    vocab = runner.model_config.vocab_size
    if length > 0:  # (0: the table only)
        fast.update(first_prompt(model_dir, args.device, length, vocab, bs, budget))
        # the same probe with the start-up rehearsal off: what the rehearsal takes away
        off = first_prompt(model_dir, args.device, length, vocab, bs, budget, 10, False)
        fast["no_rehearsal"] = {
            k: v for k, v in off.items() if k.startswith(("first_prompt", "next"))
        }
    Path(args.fast_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.fast_out).write_text(json.dumps(fast, indent=2))
    print(f"wrote {args.fast_out}", file=sys.stderr)
