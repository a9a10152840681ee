"""`splitserve decode-worker --model DIR`: serve the DecodeWorker gRPC API until SIGTERM.

Settings come from --config YAML (see decode_worker/config.py), then the flags on top (the
shared worker flags: cli/worker_args.py, and the decode-only ones below). Also runnable
alone: `python -m splitserve.cli.decode_worker_cmd --model DIR ...`.
"""

from __future__ import annotations

import argparse
import sys

from splitserve.cli.arg_types import token_counts
from splitserve.cli.worker_args import add_shared_arguments, run_worker_command

# decode-only flag dest -> dotted config field
_OVERRIDES = {
    "max_batch_size": "engine.scheduler.max_batch_size",
    "cuda_graph": "cuda_graph",
    "cuda_graph_sizes": "cuda_graph_sizes",
    "prefill_graph_sizes": "prefill_graph_sizes",
    "prefill_chunk_tokens": "prefill_chunk_tokens",
    "rehearsal": "rehearsal",
    "kv_failure_policy": "kv_transfer.failure_policy",
    "kv_data_timeout_s": "kv_transfer.data_timeout_s",
    "kv_connect_timeout_s": "kv_transfer.connect_timeout_s",
}


def _sizes(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated batch sizes like 1,2,4,8,16, got {text!r}"
        ) from None


def register(sub) -> None:
    p = sub.add_parser(
        "decode-worker", help="continue prefilled requests in a CUDA-graph decode batch"
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shared_arguments(p, "DecodeWorkerConfig")
    p.add_argument("--max-batch-size", type=int, help="sequences decoded per step (default 256)")
    p.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_const",
        const=False,
        default=None,
        help="run every decode step eagerly (no CUDA graph capture)",
    )
    p.add_argument(
        "--rehearsal",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after warm-up, run one colocated request per local-prefill token bucket before "
        "serving (default: on CUDA only)",
    )
    p.add_argument(
        "--cuda-graph-sizes",
        type=_sizes,
        metavar="N,N,...",
        help="batch sizes to capture (default 1,2,4,8, then steps of 8 up to --max-batch-size)",
    )
    p.add_argument(
        "--prefill-graph-sizes",
        type=token_counts,
        metavar="N,N,...",
        help="token counts of the local prefill's piecewise graphs (default 16, 32, ... up to "
        "--max-num-batched-tokens, at most 8192; larger counts are captured at that budget)",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        metavar="N",
        help="local-prefill tokens (colocated prompts, recompute) per step, between decode "
        "steps (default 512; 0: each prompt whole in one step)",
    )
    p.add_argument(
        "--kv-failure-policy",
        choices=["recompute", "fail"],
        help="a failed KV pull: recompute the prompt here (default) or end with UNAVAILABLE",
    )
    p.add_argument("--kv-connect-timeout-s", type=float, help="UCX connect timeout (default 5)")
    p.add_argument(
        "--kv-data-timeout-s", type=float, help="KV payload receive timeout (default 30)"
    )


def run(args: argparse.Namespace) -> int:
    from splitserve.decode_worker.config import load
    from splitserve.decode_worker.worker import run_worker

    return run_worker_command(args, _OVERRIDES, load, run_worker)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (the launcher starts children this way)."""
    from splitserve.cli.standalone import standalone_main

    return standalone_main("decode-worker", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
