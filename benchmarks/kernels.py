"""Micro-benchmarks of the Triton hot-path kernels on one GPU.

For every kernel and shape it prints the time (CUDA events around a CUDA-graph replay, L2
flushed before each run), the achieved bandwidth (bytes read + written) as a fraction of the
device copy bandwidth measured in the same run, and the speed-up over the torch path on the
same inputs: eager torch reference ops (graphed too) for the elementwise kernels, gather +
SDPA / dense SDPA for attention, the unfused norm / activation kernel + cuBLAS F.linear for the
small-M fused linear kernels (kernels_linear.py). Writes everything to a JSON file (--out).

    python benchmarks/kernels.py --out results/kernels.json
    python benchmarks/kernels.py --only small_m_linear --sweep-linear --linear-m 1,4
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernels_*, also when imported
from kernels_cases import MODEL, add_attention_cases, add_elementwise_cases  # noqa: E402
from kernels_linear import add_linear_cases, check_linear_cases, sweep_linear  # noqa: E402

COPY_BYTES = 2 * 2**30
FLUSH_BYTES = 256 * 2**20
DEVICE = "cuda"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument(
        "--iters", type=int, default=50, help="timed runs per measurement (median reported)"
    )
    p.add_argument("--only", default=None, help="regex: run only cases whose name matches")
    p.add_argument("--no-reference", action="store_true", help="skip the torch reference timings")
    p.add_argument(
        "--no-check", action="store_true", help="skip the output check against the reference"
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also time decode-attention tile variants (BLOCK_N x num_stages x num_warps) per shape",
    )
    p.add_argument(
        "--sweep-linear",
        action="store_true",
        help="also time small-M linear tile variants (BLOCK_N x BLOCK_K x num_warps x num_stages) per shape",
    )
    p.add_argument(
        "--linear-m", default="1", help="comma-separated token counts for the small-M linear cases"
    )
    return p.parse_args(argv)


@dataclass
class Case:
    name: str  # kernel/shape label
    kernel: str
    shape: dict
    bytes: int  # compulsory bytes read + written by the op
    flops: float = 0.0
    results: dict = field(default_factory=dict)


class Timer:
    """Median GPU time of `fn`: captured in a CUDA graph (no launch overhead, the way decode
    runs), or run eagerly when it syncs on the host. The L2 is flushed before every run; the
    flush also keeps the host ahead of the GPU, so the events time only GPU work."""

    def __init__(self, torch, iters: int):
        self.torch = torch
        self.iters = iters
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=DEVICE)

    def __call__(self, fn, graph: bool = True) -> float:
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles kernels before any capture
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        run = fn
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.iters)
        ]
        for start, end in events:
            self.flush.zero_()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in events)
        return times[len(times) // 2]


def copy_bandwidth(torch, timer: Timer) -> float:
    """Bytes read + written per second by a large device-to-device copy (the roofline)."""
    # fp32 elements: a byte-typed copy_ takes a slower, narrower path and under-reports HBM.
    n = COPY_BYTES
    src = torch.empty(n // 4, dtype=torch.float32, device=DEVICE)
    dst = torch.empty_like(src)
    # not graphed: a captured copy_ becomes a memcpy node served by the copy engines (~2.8 TB/s
    # on the H200), while the eager copy runs as an SM kernel at full HBM speed.
    ms = timer(lambda: dst.copy_(src), graph=False)
    src = dst = None  # free the buffers now (the closures above hold the names)
    return 2 * n / (ms * 1e-3)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import triton
    from tqdm import tqdm

    if not torch.cuda.is_available():
        print("kernels benchmark needs a CUDA GPU", file=sys.stderr)
        return 2

    from splitserve.kernels import reference
    from splitserve.kernels import triton_ops as tri
    from splitserve.kernels.triton_decode_attention import paged_decode_attention_impl

    dev = DEVICE
    bf16 = torch.bfloat16
    el = 2  # bytes per bf16 element
    gen = torch.Generator(device=dev).manual_seed(0)
    timer = Timer(torch, args.iters)
    print(
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}"
    )
    copy_bw = copy_bandwidth(torch, timer)
    print(f"device copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")

    def rnd(*shape, dtype=bf16):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    scale = MODEL["d"] ** -0.5
    cases: list[
        tuple[Case, object, object]
    ] = []  # (case, triton fn, (ref name, ref fn, graphable))

    def add(case, fn, ref=None) -> bool:
        if args.only is None or re.search(args.only, case.name):
            cases.append((case, fn, ref))
            return True
        return False

    add_elementwise_cases(add, Case, rnd, torch, tri, reference, gen, dev, el)
    decode_inputs = add_attention_cases(
        add, Case, cases, rnd, torch, tri, gen, dev, not args.no_check, el
    )

    # --- small-M linear (decode GEMV) --------------------------------------------------
    linear_inputs = add_linear_cases(
        add, Case, rnd, torch, tri, [int(m) for m in args.linear_m.split(",")], el
    )

    if not args.no_check:  # decode: Triton vs gather + SDPA on the benchmark inputs
        for case, fn, ref in cases:
            if case.kernel == "paged_decode_attention":
                case.results["max_abs_err_vs_sdpa"] = (
                    (fn().float() - ref[1]().float()).abs().max().item()
                )
        check_linear_cases(cases, torch)

    rows = []
    header = (
        f"{'case':44s} {'triton us':>10s} {'GB/s':>8s} {'%copy':>6s} {'TFLOP/s':>8s} "
        f"{'ref':>20s} {'ref us':>10s} {'speedup':>8s}"
    )
    print(header)
    bar = tqdm(cases, desc="kernels", unit="case", file=sys.stderr)
    t0 = time.time()
    for case, fn, ref in bar:
        bar.set_postfix_str(case.name)
        ms = timer(fn, graph=True)
        res = case.results
        res["triton_us"] = ms * 1e3
        res["GBps"] = case.bytes / (ms * 1e-3) / 1e9
        res["frac_copy_bw"] = case.bytes / (ms * 1e-3) / copy_bw
        if case.flops:
            res["TFLOPs"] = case.flops / (ms * 1e-3) / 1e12
        if ref is not None and not args.no_reference:
            ref_name, ref_fn, graphable = ref
            ref_ms = timer(ref_fn, graph=graphable)
            res.update(ref=ref_name, ref_us=ref_ms * 1e3, speedup_vs_ref=ref_ms / ms)
        tflops = f"{res['TFLOPs']:8.1f}" if case.flops else f"{'':8s}"
        bar.write(
            f"{case.name:44s} {res['triton_us']:10.1f} {res['GBps']:8.0f} {100 * res['frac_copy_bw']:5.1f}% "
            f"{tflops} {res.get('ref', '-'):>20s} {res.get('ref_us', math.nan):10.1f} "
            f"{res.get('speedup_vs_ref', math.nan):7.2f}x"
        )
        rows.append(asdict(case))
    print(f"done: {len(rows)} cases in {time.time() - t0:.0f} s")

    sweep = []
    if args.sweep:  # tuning data for the decode kernel's constants, same inputs as above
        variants = [(bn, st, nw) for bn in (32, 64, 128) for st in (2, 3, 4) for nw in (4, 8)]
        for case, _, _ in (c for c in cases if c[0].kernel == "paged_decode_attention"):
            fn_inputs = decode_inputs[case.name]
            for bn, st, nw in tqdm(variants, desc=f"sweep {case.name}", file=sys.stderr):
                try:
                    ms = timer(
                        lambda: paged_decode_attention_impl(
                            *fn_inputs, scale, block_n=bn, num_stages=st, num_warps=nw
                        )
                    )
                except Exception as exc:  # e.g. out of shared memory for a big tile
                    sweep.append(
                        dict(
                            case=case.name,
                            block_n=bn,
                            num_stages=st,
                            num_warps=nw,
                            error=str(exc)[:200],
                        )
                    )
                    continue
                frac = case.bytes / (ms * 1e-3) / copy_bw
                sweep.append(
                    dict(
                        case=case.name,
                        block_n=bn,
                        num_stages=st,
                        num_warps=nw,
                        us=ms * 1e3,
                        frac_copy_bw=frac,
                    )
                )
                tqdm.write(
                    f"  {case.name:40s} BLOCK_N={bn:3d} stages={st} warps={nw}: {ms * 1e3:8.1f} us "
                    f"{100 * frac:5.1f}% copy bw"
                )

    linear_sweep = (
        sweep_linear(cases, linear_inputs, timer, copy_bw, tqdm) if args.sweep_linear else []
    )

    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        copy_bandwidth_GBps=copy_bw / 1e9,
        iters=args.iters,
        cases=rows,
        decode_sweep=sweep,
        linear_sweep=linear_sweep,
    )
    if args.out:
        import pathlib

        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
