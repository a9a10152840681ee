"""Where a prefill worker's threads spend the first prompt after SERVING (issue 31's first-prompt
ratio), against a later one: the worker runs under a stack sampler (every thread's Python stack
about every 0.5 ms, between SIGUSR1 and SIGUSR2 around each prompt), started with an empty
TRITON_CACHE_DIR as `benchmarks/prefill_fast.first_prompt` starts it. Prints each prompt's
latency, then the busy stacks (idle waits left out) of the first prompt beside the third's,
largest difference first: host work the first prompt pays once shows at the top.

    python benchmarks/prefill_first_prompt_stacks.py --model-dir /tmp/l1b --length 3072
    python benchmarks/prefill_first_prompt_stacks.py --model-dir ~/.cache/splitserve/models/tiny \
        --device cpu --length 200
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

IDLE = re.compile(r"thread\.py:\d+:_worker|selectors\.py|threading\.py:\d+:wait|_poll_wrapper")


def _sampled_worker(argv: list[str]) -> int:
    """The worker process: splitserve's CLI with the sampler thread and its two signals."""
    on, counts, samples, phase = threading.Event(), collections.Counter(), [0], [0]

    def sample() -> None:
        me = threading.get_ident()
        while True:
            on.wait()
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid != me:
                    stack = traceback.extract_stack(frame)[-7:]
                    where = " < ".join(
                        f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(stack)
                    )
                    counts[f"{names.get(tid, tid)} | {where}"] += 1
            samples[0] += 1
            time.sleep(0.0005)

    def start(*_) -> None:
        counts.clear()
        samples[0] = 0
        on.set()

    def stop(*_) -> None:
        on.clear()
        out = Path(os.environ["STACKS_DIR"]) / f"phase_{phase[0]}.json"
        out.write_text(json.dumps({"samples": samples[0], "stacks": dict(counts)}))
        phase[0] += 1

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    threading.Thread(target=sample, daemon=True, name="stack-sampler").start()
    from splitserve.cli.main import main

    return main(argv)


def _busy(path: Path) -> tuple[int, collections.Counter]:
    data = json.loads(path.read_text())
    busy = collections.Counter()
    for key, n in data["stacks"].items():
        if not IDLE.search(" < ".join(key.split(" < ")[:2])):
            busy[key] += n
    return data["samples"], busy


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        return _sampled_worker(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--length", type=int, default=3072)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    import grpc

    from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from prefill_fast import SERVING_LINE, _lines, stop_worker

    config = Path(args.model_dir) / "config.json"
    if not config.is_file():
        print(f"no checkpoint at {args.model_dir} (no config.json)", file=sys.stderr)
        return 1
    vocab = json.loads(config.read_text())["vocab_size"]
    stacks = Path(tempfile.mkdtemp(prefix="stacks-"))
    env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(), "STACKS_DIR": str(stacks)}
    cmd = [
        sys.executable, __file__, "--worker", "prefill-worker", "--model", args.model_dir,
        "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", args.device,
        "--max-model-len", str(args.length + 16),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        print("waiting for the worker to say SERVING ...", file=sys.stderr)
        seen: list[str] = []
        while (line := lines.get(timeout=600)) is not None and not (m := SERVING_LINE.search(line)):
            seen.append(line)
        if line is None:  # its output ended before SERVING: say why
            print("the worker exited before SERVING:\n" + "".join(seen[-20:]), file=sys.stderr)
            return 1
        params = generate_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        with grpc.insecure_channel(f"{m[1]}:{m[2]}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            for i in range(args.prompts):
                prompt = [
                    (7919 * (i + 11) + 104729 * j) % (vocab - 3) + 3 for j in range(args.length)
                ]
                req = worker_pb2.PrefillRequest(
                    request_id=f"p{i}", prompt_token_ids=prompt, sampling=params
                )
                proc.send_signal(signal.SIGUSR1)
                time.sleep(0.05)
                start = time.perf_counter()
                resp = stub.Prefill(req, timeout=600)
                ms = (time.perf_counter() - start) * 1e3
                time.sleep(0.05)
                proc.send_signal(signal.SIGUSR2)
                deadline = time.monotonic() + 30
                while not (stacks / f"phase_{i}.json").exists():
                    if time.monotonic() > deadline or proc.poll() is not None:
                        print(f"the worker wrote no stacks for prompt {i}", file=sys.stderr)
                        return 1
                    time.sleep(0.01)
                print(f"prompt {i}: {ms:.1f} ms (worker compute {resp.compute_time_ms:.1f} ms)")
                stub.ReleaseLease(
                    worker_pb2.ReleaseLeaseRequest(lease_id=resp.kv.lease_id, request_id=f"p{i}"),
                    timeout=30,
                )
    finally:
        stop_worker(proc)
    (n0, first), (n2, third) = (
        _busy(stacks / "phase_0.json"),
        _busy(stacks / f"phase_{min(2, args.prompts - 1)}.json"),
    )
    print(
        f"busy stack samples: first prompt {sum(first.values())} of {n0}, third {sum(third.values())} of {n2}"
    )
    for key in sorted(set(first) | set(third), key=lambda k: third[k] - first[k])[: args.top]:
        print(f"{first[key]:5d} {third[key]:5d}  {key[:400]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
