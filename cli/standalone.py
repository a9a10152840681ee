"""Runs one subcommand module on its own (`python -m splitserve.cli.serve_cmd ...`), with the
same one-line errors as cli/main.py; `splitserve serve` starts its children this way."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

from splitserve.service.service_process import die_with_launcher, end_cli, service_ran


def standalone_main(
    command: str,
    doc: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    die_with_launcher()
    parser = argparse.ArgumentParser(
        prog=f"splitserve {command}", description=doc.strip().splitlines()[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        code = int(run(args) or 0)
    except KeyboardInterrupt:
        print(f"splitserve {command}: interrupted", file=sys.stderr)
        code = 130
    except (ValueError, FileNotFoundError, MemoryError, RuntimeError) as exc:
        print(f"splitserve {command}: error: {exc}", file=sys.stderr)
        code = 2
    except Exception:  # a bug: its traceback, then the service process still ends on its own terms
        if not service_ran():
            raise
        traceback.print_exc()
        code = 1
    return end_cli(code)
