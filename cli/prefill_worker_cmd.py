"""`splitserve prefill-worker --model DIR`: serve the PrefillWorker gRPC API until SIGTERM.

Settings come from --config YAML (see prefill_worker/config.py), then the flags on top (the
shared worker flags: cli/worker_args.py, and the prefill-only ones below). Also runnable
alone: `python -m splitserve.cli.prefill_worker_cmd --model DIR ...`.
"""

from __future__ import annotations

import argparse
import sys

from splitserve.cli.worker_args import add_shared_arguments, run_worker_command

_OVERRIDES = {"lease_ttl_s": "lease_ttl_s"}  # prefill-only flag dest -> config field


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
