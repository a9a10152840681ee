"""`splitserve health HOST:PORT [--service NAME]`: one grpc.health.v1 Check; exit 0 when SERVING.

For container health checks (grpc_health_probe is not needed):

    splitserve health 127.0.0.1:50051 --service splitserve.v1.GenerateService
    splitserve health 127.0.0.1:50051 --tls-ca-file /run/tls/ca.pem   # a TLS port (docs/tls.md)

Prints `SERVING` (exit 0), or one line saying what it got instead (exit 1).
Also runnable alone: `python -m splitserve.cli.health_cmd HOST:PORT`.
"""

from __future__ import annotations

import argparse
import sys

from splitserve.service.tls_flags import add_client_tls_arguments, client_tls_from_args


def register(sub) -> None:
    p = sub.add_parser(
        "health", help="check a service's grpc.health.v1 status (exit 0 when SERVING)"
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", metavar="HOST:PORT", help="the service's gRPC address")
    p.add_argument(
        "--service",
        default="",
        help="service name, e.g. splitserve.v1.DecodeWorker (default '': the whole server)",
    )
    p.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)"
    )
    add_client_tls_arguments(p)


def run(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.service.tls import open_channel

    with open_channel(args.address, client_tls_from_args(args), aio=False) as channel:
        try:
            status = (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
                .status
            )
        except grpc.RpcError as err:
            print(
                f"splitserve health: {args.address}: {err.code().name}: {' '.join((err.details() or '').split())}",
                file=sys.stderr,
            )
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    if status != health_pb2.HealthCheckResponse.SERVING:
        print(
            f"splitserve health: {args.address} {args.service or '(server)'} is {name}",
            file=sys.stderr,
        )
        return 1
    print(name)
    return 0


def main(argv: list[str] | None = None) -> int:
    from splitserve.cli.standalone import standalone_main

    return standalone_main("health", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
