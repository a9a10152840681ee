"""Where one model step's time goes (llama-3.2-1b shape): wall time per step, summed GPU kernel
time, kernel count, the top GPU kernels and the top host-side ops, from torch.profiler.

    python benchmarks/profile_step.py --model-dir /tmp/llama --phase decode --batch 1
    python benchmarks/profile_step.py --model-dir /tmp/llama --phase prefill --tokens 1024

Eager steps: for decode this shows the GPU time a CUDA graph replays; for prefill (not graphed)
the gap between wall time and GPU time is host/launch overhead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", required=True)
    p.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    p.add_argument("--batch", type=int, default=1, help="decode: sequences")
    p.add_argument("--context", type=int, default=512, help="decode: tokens per sequence")
    p.add_argument("--tokens", type=int, default=1024, help="prefill: prompt length")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from splitserve.cli.make_model import make_model
    from splitserve.config.engine_config import EngineConfig
    from splitserve.engine.model_runner import DecodeLane, ModelRunner, PrefillChunk

    if not os.path.exists(f"{args.model_dir}/config.json"):
        make_model("llama-3.2-1b", args.model_dir)
    runner = ModelRunner(
        EngineConfig(
            model_path=args.model_dir, scheduler={"max_model_len": 8192}, cache={"num_blocks": 4096}
        )
    )
    if args.phase == "decode":
        per = -(-(args.context + 1) // runner.block_size)
        lanes = [
            DecodeLane(5, args.context, list(range(1 + b * per, 1 + (b + 1) * per)))
            for b in range(args.batch)
        ]
        step = lambda: runner.decode(lanes)  # noqa: E731
        what = f"decode batch {args.batch}, context {args.context}"
    else:
        table = list(range(1, 1 + -(-args.tokens // runner.block_size)))
        chunk = [PrefillChunk(list(range(7, 7 + args.tokens)), 0, table)]
        step = lambda: runner.prefill(chunk)  # noqa: E731
        what = f"prefill of one {args.tokens}-token prompt"
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    n = 5
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time_total for e in gpu) / n
    launches = sum(e.count for e in gpu) / n
    print(
        f"{what}: wall {wall * 1e3:.3f} ms per step, GPU kernel time {gpu_us / 1e3:.3f} ms, "
        f"{launches:.0f} kernels per step"
    )
    print("top GPU kernels (us per step, launches per step):")
    for e in sorted(gpu, key=lambda e: -e.device_time_total)[: args.top]:
        print(f"  {e.device_time_total / n:9.1f}  {e.count / n:5.0f}x  {e.key[:90]}")
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    print("top host ops (self CPU us per step, calls per step):")
    for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        print(f"  {e.self_cpu_time_total / n:9.1f}  {e.count / n:5.0f}x  {e.key[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
