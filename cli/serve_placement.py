"""Where `splitserve serve` puts each worker: its --device and --tensor-parallel-size.

    --device cuda:B, P prefill workers of TP p, D decode workers of TP d:

        prefill-0  cuda:B .. B+p-1        decode-0  cuda:B+P*p .. B+P*p+d-1
        prefill-1  cuda:B+p .. B+2p-1     decode-1  ...                       (B+P*p+D*d <= GPUs)

A worker of TP n on cuda:i runs its ranks on cuda:i..cuda:i+n-1 (engine/parallel.py), so the
ranges never overlap. Too few GPUs is refused before anything starts; the one exception keeps
the single-GPU demo working: when every worker is TP1 they share the --device GPU, as before.
On CPU (or with the workers' default device) every worker gets the same --device.
"""

from __future__ import annotations

import argparse


def tp_sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(prefill TP, decode TP): each defaults to --tensor-parallel-size, itself 1 by default."""
    both = 1 if args.tensor_parallel_size is None else args.tensor_parallel_size
    sizes = tuple(
        both if n is None else n
        for n in (args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size)
    )
    for flag, n in zip(("--prefill-tensor-parallel-size", "--decode-tensor-parallel-size"), sizes):
        if n < 1:
            raise ValueError(f"{flag} must be >= 1, got {n}")
    return sizes


def _cuda_base(device: str | None) -> int | None:
    """The first GPU index of --device cuda / cuda:N; None for anything else."""
    if device is None or not device.startswith("cuda"):
        return None
    index = device.partition(":")[2]
    if index and not index.isdigit():
        raise ValueError(f"--device {device}: give cuda or cuda:N")
    return int(index or 0)


def worker_flags(
    args: argparse.Namespace, num_prefill: int, num_decode: int, gpu_count: int | None = None
) -> tuple[list[list[str]], list[list[str]]]:
    """Per prefill worker and per decode worker, the --device / --tensor-parallel-size flags;
    `gpu_count` (None: ask torch) only matters with --device cuda[:N]. ValueError when the GPUs
    are too few."""
    p_tp, d_tp = tp_sizes(args)

    def flags(device: str | None, tp: int) -> list[str]:
        out = [] if device is None else ["--device", device]
        return out + (["--tensor-parallel-size", str(tp)] if tp > 1 else [])

    base = _cuda_base(args.device)
    needed = num_prefill * p_tp + num_decode * d_tp
    if base is not None:
        if gpu_count is None:
            import torch

            gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if base + needed > gpu_count:
            if p_tp == d_tp == 1 and base < gpu_count:  # TP1 workers share the GPU, as before
                return [flags(args.device, 1)] * num_prefill, [flags(args.device, 1)] * num_decode
            raise ValueError(
                f"{num_prefill} prefill worker(s) x TP{p_tp} + {num_decode} decode worker(s) x TP{d_tp} "
                f"need {needed} GPUs from cuda:{base} (each worker its own), but {gpu_count} are "
                "visible; lower --num-prefill/--num-decode or the tensor-parallel sizes"
            )
        firsts = [base + i * p_tp for i in range(num_prefill)]
        firsts += [base + num_prefill * p_tp + j * d_tp for j in range(num_decode)]
        return (
            [flags(f"cuda:{f}", p_tp) for f in firsts[:num_prefill]],
            [flags(f"cuda:{f}", d_tp) for f in firsts[num_prefill:]],
        )
    return [flags(args.device, p_tp)] * num_prefill, [flags(args.device, d_tp)] * num_decode
