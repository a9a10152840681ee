"""Where a decode step's GPU time goes: per-kernel CUDA time of one eager decode step of the
llama-3.2-1b shape at a given batch, from torch.profiler (GPU time only, launch gaps excluded).

    python benchmarks/profile_decode.py --model-dir /tmp/llama --batch 1
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.make_model import make_model
    from splitserve.engine.model_runner import DecodeLane, ModelRunner

    make_model("llama-3.2-1b", args.model_dir) if not __import__("os").path.exists(
        f"{args.model_dir}/config.json") else None
    runner = ModelRunner(EngineConfig(model_path=args.model_dir, scheduler={"max_model_len": 2048},
                                      cache={"num_blocks": 4096}))
    per = -(-(args.context + 1) // runner.block_size)
    lanes = [DecodeLane(5, args.context, list(range(1 + b * per, 1 + (b + 1) * per))) for b in range(args.batch)]
    for _ in range(3):
        runner.decode(lanes)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.decode(lanes)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in events) / 5
    print(f"batch {args.batch}, context {args.context}: GPU kernel time per step {total / 1000:.3f} ms")
    for e in sorted(events, key=lambda e: -e.device_time_total)[: args.top]:
        print(f"{e.device_time_total / 5:9.1f} us  {e.count // 5:4d}x  {e.key[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
