"""Per-kernel GPU time of the device sampler (kernels/triton_sampling*.py) at each mode and batch,
from torch.profiler (CUPTI), on logits of the llama-3.2-1b vocabulary: where a sampled step's
time goes. `flat` logits (a random-weight model's) are the sampler's worst case for top-p.

    python benchmarks/sampling_kernels.py --batch-sizes 1,256 --out sampling_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from decode_sampling import mode_params


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--scale", type=float, default=0.05, help="logit std (0.05: a random model's)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from splitserve.engine.sampling_state import RowInit, SamplingState, has_filters, sample_step

    dev = torch.device("cuda")
    rows_out = []
    for b in [int(s) for s in args.batch_sizes.split(",")]:
        for mode in ("temp_top_p", "seeded_top_k", "penalties", "logprobs5", "mixed"):
            params = [mode_params(mode, i, 64) for i in range(b)]
            rows = [
                RowInit(p, list(range(1, 200)), list(range(5, 40)), 7 + i, 35)
                for i, p in enumerate(params)
            ]
            state = SamplingState.from_rows(rows, args.vocab, (2,), dev)
            logits = torch.randn(b, args.vocab, device=dev) * args.scale
            slots = torch.arange(b, device=dev)
            live = torch.zeros(b, dtype=torch.int64, device=dev)  # keep the state fixed
            out = torch.empty(b, dtype=torch.int64, device=dev)
            filters = any(has_filters(p) for p in params)
            from splitserve.engine.sampling_state import LogprobBuffers

            lp = (
                LogprobBuffers.empty(b, args.vocab, dev) if mode in ("logprobs5", "mixed") else None
            )
            for _ in range(3):
                sample_step(logits.clone(), slots, live, state, out, lp, filters)
            torch.cuda.synchronize()
            xs = [logits.clone() for _ in range(args.iters)]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for x in xs:
                    sample_step(x, slots, live, state, out, lp, filters)
                torch.cuda.synchronize()
            per = defaultdict(float)
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    per[e.name[:60]] += e.device_time_total / args.iters / 1000.0
            total = sum(per.values())
            row = {"batch": b, "mode": mode, "gpu_ms": total, "kernels_ms": dict(per)}
            print(
                f"batch={b} {mode}: {total:.3f} ms  "
                + ", ".join(
                    f"{k.split('(')[0][:28]}={v:.3f}"
                    for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:8]
                ),
                flush=True,
            )
            rows_out.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": rows_out, "vocab": args.vocab, "scale": args.scale}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
