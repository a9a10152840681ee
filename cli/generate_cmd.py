"""`splitserve generate "PROMPT"`: send one prompt to a running router and stream the text.

    splitserve serve &                        # router on 127.0.0.1:50051
    splitserve generate "Hello" --max-tokens 32
    splitserve generate "Hello" --json        # one JSON object: text, token_ids, finish_reason, usage
    splitserve generate "Hello" --address router.example:50051 --tls-ca-file ca.pem   # docs/tls.md
    SPLITSERVE_API_KEY=KEY splitserve generate "Hello" --address router.example:50051
                                              # a router with API keys (docs/security.md)

The address comes from --address, else $SPLITSERVE_ADDRESS, else 127.0.0.1:50051 (the
default of `splitserve serve`). Errors print one line with the gRPC status and message.
Also runnable alone: `python -m splitserve.cli.generate_cmd "PROMPT" ...`.
"""

from __future__ import annotations

import argparse
import sys

from splitserve.cli import client
from splitserve.cli.api_key import add_api_key_argument, api_key_from_args
from splitserve.service.tls_flags import add_client_tls_arguments, client_tls_from_args


def register(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running router (gRPC client)")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text (or token ids with --token-ids, e.g. '1,2,3')")
    p.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help=f"router address (default ${client.ADDRESS_ENV}, else 127.0.0.1:{client.DEFAULT_PORT})",
    )
    p.add_argument(
        "--token-ids", action="store_true", help="PROMPT is comma-separated token ids, not text"
    )
    add_api_key_argument(p)
    client.add_sampling_arguments(p)
    add_client_tls_arguments(p)


def parse_prompt(args: argparse.Namespace) -> str | list[int]:
    if not args.token_ids:
        return args.prompt
    try:
        return [int(t) for t in args.prompt.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(
            f"--token-ids wants comma-separated integers like 1,2,3, got {args.prompt!r}"
        ) from None


def run(args: argparse.Namespace) -> int:
    address = args.address or client.default_address()
    tls = client_tls_from_args(args)
    try:
        client.stream_to(
            sys.stdout, address, parse_prompt(args), args, tls=tls, api_key=api_key_from_args(args)
        )
    except client.GenerateError as exc:
        print(f"splitserve generate: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from splitserve.cli.standalone import standalone_main

    return standalone_main("generate", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
