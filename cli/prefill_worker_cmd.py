"""`splitserve prefill-worker --model DIR`: serve the PrefillWorker gRPC API until SIGTERM.

Settings come from --config YAML (see prefill_worker/config.py), then the flags on top (the
shared worker flags: cli/worker_args.py, and the prefill-only ones below). Also runnable
alone: `python -m splitserve.cli.prefill_worker_cmd --model DIR ...`.
"""

from __future__ import annotations

import argparse
import sys

from splitserve.cli.arg_types import token_counts
from splitserve.cli.worker_args import add_shared_arguments, run_worker_command

# prefill-only flag dest -> config field
_OVERRIDES = {
    "lease_ttl_s": "lease_ttl_s",
    "cuda_graph": "cuda_graph",
    "prefill_graph_sizes": "prefill_graph_sizes",
    "rehearsal": "rehearsal",
}


def register(sub) -> None:
    p = sub.add_parser(
        "prefill-worker", help="serve prompts (context-only) and hand their KV to decode workers"
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shared_arguments(p, "PrefillWorkerConfig")
    p.add_argument(
        "--lease-ttl-s", type=float, help="seconds finished KV stays pinned for the decode side"
    )
    p.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_const",
        const=False,
        default=None,
        help="run every prefill step eagerly (no piecewise CUDA graphs)",
    )
    p.add_argument(
        "--rehearsal",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after warm-up, run one request per token bucket through the request path before "
        "serving (default: on CUDA only)",
    )
    p.add_argument(
        "--prefill-graph-sizes",
        type=token_counts,
        metavar="N,N,...",
        help="token counts of the piecewise prefill graphs (default 16, 32, ... up to "
        "--max-num-batched-tokens, at most 8192; larger counts are captured at that budget)",
    )


def run(args: argparse.Namespace) -> int:
    from splitserve.prefill_worker.config import PrefillWorkerConfig
    from splitserve.prefill_worker.worker import run_worker

    return run_worker_command(args, _OVERRIDES, PrefillWorkerConfig.load, run_worker)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (the launcher starts children this way)."""
    from splitserve.cli.standalone import standalone_main

    return standalone_main("prefill-worker", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
