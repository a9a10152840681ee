"""Fair placement for serving_compare.py: both modes get the same N GPUs.

    plan_placement(gpus, pd_ratio=None, device="cuda", visible=None)
        -> {"colocated": Side, "disaggregated": Side}, Side = {"serve_flags": [...],
           "env": {"CUDA_VISIBLE_DEVICES": ...}, "workers": {name: device}, "devices": [...],
           "shared_gpu": bool}

colocated:      N decode workers that also prefill (`serve --colocated --num-decode N`), one per GPU
disaggregated:  P prefill + D decode workers, P + D = N, one per GPU; N = 1: both on cuda:0, which
                `serve` runs under MPS (cli/serve_mps.py, --prefill-sm-share)

The P:D split is `--pd-ratio P:D`, else the default rule: P = N // 2, D = N - P (decode takes the
odd GPU: decode holds every running sequence's KV for the whole output, prefill only per prompt).
Each `serve` sees exactly the first N GPUs (CUDA_VISIBLE_DEVICES), so on a bigger host neither side
spreads over more. The devices come from serve's own placement (cli/serve_placement.py), not
from a copy of its rule. A bad ratio or GPU count raises ValueError with one line saying how to fix
it.
"""

from __future__ import annotations

import argparse

from splitserve.cli.serve_args import add_arguments, check_args
from splitserve.cli.serve_placement import worker_flags

MODES = ("disaggregated", "colocated")


def parse_pd_ratio(text: str | None, gpus: int) -> tuple[int, int]:
    """'P:D' -> (P, D) with P, D >= 1 and P + D == gpus (gpus == 1: only 1:1, sharing the GPU)."""
    if text is None:
        if gpus == 1:
            return 1, 1
        return gpus // 2, gpus - gpus // 2
    p, sep, d = text.partition(":")
    if not sep or not p.strip().isdigit() or not d.strip().isdigit():
        raise ValueError(f"--pd-ratio wants P:D with whole numbers, like 1:1 or 1:3, got {text!r}")
    p_n, d_n = int(p), int(d)
    if p_n < 1 or d_n < 1:
        raise ValueError(f"--pd-ratio {text}: each side needs at least one GPU (P >= 1, D >= 1)")
    if gpus == 1:
        if (p_n, d_n) != (1, 1):
            raise ValueError(
                f"--pd-ratio {text} with --gpus 1: one GPU holds one prefill and one decode worker "
                "(1:1, under MPS); leave --pd-ratio out or give --gpus P+D"
            )
    elif p_n + d_n != gpus:
        raise ValueError(
            f"--pd-ratio {text} splits {p_n + d_n} GPUs but --gpus is {gpus}: make P + D = {gpus} "
            "so that both modes get the same GPUs"
        )
    return p_n, d_n


def _visible(gpus: int, visible: str | None) -> str:
    """The first `gpus` entries of CUDA_VISIBLE_DEVICES (all GPUs when unset)."""
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    if ids is None:
        return ",".join(str(i) for i in range(gpus))
    if len(ids) < gpus:
        raise ValueError(
            f"--gpus {gpus}, but CUDA_VISIBLE_DEVICES={visible} names only {len(ids)}; "
            "lower --gpus or widen CUDA_VISIBLE_DEVICES"
        )
    return ",".join(ids[:gpus])


def _side(flags: list[str], gpus: int, on_gpu: bool, env: dict[str, str]) -> dict:
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    args = parser.parse_args([*flags, "--port", "0"])
    num_prefill, num_decode = check_args(args)
    prefill_at, decode_at = worker_flags(args, num_prefill, num_decode, gpu_count=gpus)

    def device(worker: list[str]) -> str:
        d = worker[worker.index("--device") + 1]
        return "cuda:0" if d == "cuda" else d  # the shared-GPU case keeps the bare name

    workers = {f"prefill-{i}": device(f) for i, f in enumerate(prefill_at)}
    workers |= {f"decode-{j}": device(f) for j, f in enumerate(decode_at)}
    return {
        "serve_flags": flags,
        "env": env,
        "workers": workers,
        "devices": sorted(set(workers.values())),
        "shared_gpu": on_gpu and len(set(workers.values())) < len(workers),
    }


def plan_placement(
    gpus: int, pd_ratio: str | None = None, device: str = "cuda", visible: str | None = None
) -> dict[str, dict]:
    """Both modes' serve flags and worker devices on the same `gpus` GPUs (`device` cpu: the same
    worker counts, every worker on the CPU; for the CPU tests). `visible`: the caller's
    CUDA_VISIBLE_DEVICES."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    on_gpu = device.startswith("cuda")
    if on_gpu and device not in ("cuda", "cuda:0"):
        raise ValueError(
            f"--device {device}: give cuda (the GPUs are chosen with --gpus and CUDA_VISIBLE_DEVICES)"
        )
    if not on_gpu and device != "cpu":
        raise ValueError(f"--device {device}: give cuda or cpu")
    num_prefill, num_decode = parse_pd_ratio(pd_ratio, gpus)
    env = {"CUDA_VISIBLE_DEVICES": _visible(gpus, visible)} if on_gpu else {}
    dev = ["--device", "cuda" if on_gpu else "cpu"]
    colocated = ["--colocated", "--num-decode", str(gpus), *dev]
    disaggregated = ["--num-prefill", str(num_prefill), "--num-decode", str(num_decode), *dev]
    return {
        "disaggregated": _side(disaggregated, gpus, on_gpu, env),
        "colocated": _side(colocated, gpus, on_gpu, env),
    }
