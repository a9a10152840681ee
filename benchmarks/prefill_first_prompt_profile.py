"""Why the first long prompt after SERVING is slower (issue 31's first-prompt ratio): an
in-process prefill engine set up as the worker sets it up (warm-up, graphs, prefix cache), with
an empty Triton cache, runs --prompts prompts of --length tokens one after another, the last
after a --idle-s pause; prints each one's wall ms and torch.profiler tables (by device time and
by host time) of the first, the second and the one after the pause.

If the first prompt's extra shows in the device table, a kernel or allocation differs; if only
in the host table, Python or the driver does something once; if the prompt after the pause pays
it again, it is the idle GPU / CPU waking up, which no warm-up removes.

    python benchmarks/prefill_first_prompt_profile.py --model-dir /tmp/l1b --length 3072
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--length", type=int, default=3072)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--idle-s", type=float, default=2.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--rows", type=int, default=12, help="rows per profiler table")
    p.add_argument(
        "--no-rehearsal",
        action="store_true",
        help="skip the engine's start-up rehearsal (prefill_worker/rehearsal.py), as before it",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    import torch
    from torch.profiler import ProfilerActivity, profile

    from splitserve.config.engine_config import EngineConfig
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.prefill_worker.config import PrefillWorkerConfig
    from splitserve.prefill_worker.engine import PrefillEngine
    from splitserve.request.sampling_params import SamplingParams

    cuda = args.device.startswith("cuda")

    def every_thread():  # the engine steps on its own thread
        from torch._C._profiler import _ExperimentalConfig

        try:
            return _ExperimentalConfig(profile_all_threads=True)
        except TypeError:  # an older torch: the device table still has every kernel
            return None

    cfg = EngineConfig(
        model_path=args.model_dir,
        device=args.device,
        cache={"block_size": args.block_size, "num_blocks": args.num_blocks},
        scheduler={
            "max_model_len": args.length + 16,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
    )
    runner = ModelRunner(cfg)
    worker_cfg = PrefillWorkerConfig(
        engine=cfg, enable_prefix_cache=True, warmup=True, rehearsal=not args.no_rehearsal
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    vocab = runner.model_config.vocab_size
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    by_device = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    last = args.prompts - 1
    profiled = {0: "first", 1: "second", last: f"after {args.idle_s:g} s idle"}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    async def run() -> list[float]:
        engine = PrefillEngine(worker_cfg, runner)
        start = time.perf_counter()
        await engine.start()
        print(f"warm-up {time.perf_counter() - start:.1f} s", file=sys.stderr)
        walls = []
        try:
            for i in range(args.prompts):
                if i == last:
                    await asyncio.sleep(args.idle_s)
                prompt = [(7919 * (i + 11) + 104729 * j) % (vocab - 3) + 3 for j in range(args.length)]  # fmt: skip
                prof = profile(activities=activities, experimental_config=every_thread())
                prof = prof if i in profiled else None
                if prof is not None:
                    prof.__enter__()
                sync()
                t0 = time.perf_counter()
                result = await engine.prefill(f"p{i}", prompt, params, 60.0)
                walls.append((time.perf_counter() - t0) * 1e3)
                if prof is not None:
                    prof.__exit__(None, None, None)
                    table = prof.key_averages()
                    print(f"=== prompt {i} ({profiled[i]}): {walls[-1]:.2f} ms")
                    print(table.table(sort_by=by_device, row_limit=args.rows))
                    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
                engine.release_lease(result.lease.lease_id)
        finally:
            await engine.stop()
        return walls

    walls = asyncio.run(run())
    rest = sorted(walls[1:-1])[len(walls[1:-1]) // 2] if len(walls) > 2 else walls[-1]
    print(
        f"wall ms: {', '.join(f'{w:.2f}' for w in walls)}; first / median of the rest "
        f"{walls[0] / rest:.2f}, after idle / median {walls[-1] / rest:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
