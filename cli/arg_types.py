"""argparse value types shared by the subcommands (bad values: argparse's one-line usage error)."""

from __future__ import annotations

import argparse


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: the OS picks a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0..65535")
    return value


def token_counts(text: str) -> list[int]:
    """Comma-separated token counts (graph buckets), e.g. 16,64,256."""
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts like 16,64,256, got {text!r}"
        ) from None
