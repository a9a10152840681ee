"""The `splitserve` command line. Each subcommand lives in its own module under cli/;
errors print one clear line (no traceback) and exit non-zero."""

from __future__ import annotations

import argparse
import sys
import traceback

from splitserve.cli import (
    bench_cmd,
    complete_cmd,
    decode_worker_cmd,
    generate_cmd,
    health_cmd,
    keygen_cmd,
    make_model_cmd,
    prefill_worker_cmd,
    router_cmd,
    serve_cmd,
)
from splitserve.service.service_process import die_with_launcher, end_cli, service_ran


class CliError(Exception):
    """A user-facing failure: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (
        serve_cmd,
        generate_cmd,
        bench_cmd,
        make_model_cmd,
        complete_cmd,
        prefill_worker_cmd,
        decode_worker_cmd,
        router_cmd,
        health_cmd,
        keygen_cmd,
    ):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("splitserve: interrupted", file=sys.stderr)
        code = 130
    except (CliError, ValueError, FileNotFoundError, MemoryError, RuntimeError) as exc:
        print(f"splitserve {args.command}: error: {exc}", file=sys.stderr)
        code = 2
    except Exception:  # a bug: its traceback, then the service process still ends on its own terms
        if not service_ran():
            raise
        traceback.print_exc()
        code = 1
    return end_cli(code)


if __name__ == "__main__":
    sys.exit(main())
