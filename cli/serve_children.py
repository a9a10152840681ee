"""What `splitserve serve` launches (cli/serve_cmd.py): each prefill worker, decode worker and the
router as a launcher child with its argv, on the devices serve_placement.py gives it.

    build(launcher, args, model, num_prefill, num_decode, http_port, placement)
                              adds the workers, then the router (its --prefill/--decode
                              addresses are read at each launch); with --tls-cert-file every
                              child serves TLS and the router trusts --tls-ca-file
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from splitserve.cli.launcher import Launcher
from splitserve.cli.serve_placement import worker_flags
from splitserve.service.net import free_port, is_wildcard

SERVICES = {
    "prefill-worker": "splitserve.v1.PrefillWorker",
    "decode-worker": "splitserve.v1.DecodeWorker",
    "router": "splitserve.v1.GenerateService",
}


def build(
    launcher: Launcher,
    args: argparse.Namespace,
    model: Path,
    num_prefill: int,
    num_decode: int,
    http_port: int | None = None,
    placement: tuple[list[list[str]], list[list[str]]] | None = None,
    access: list[str] | None = None,
    worker_env: Callable[[str], dict[str, str]] | None = None,
) -> None:
    """`placement`: serve_placement.worker_flags (computed here when None); `access`: the
    router's key flags (serve_args.access_args); `worker_env(role)`: extra environment of each
    prefill / decode worker (serve_mps.py: its MPS share)."""
    env_of = worker_env or (lambda role: {})
    prefill_at, decode_at = placement or worker_flags(args, num_prefill, num_decode)
    common = ["--model", str(model), "--log-level", args.log_level]
    engine = [*common]
    if is_wildcard(args.host):  # peers are all on this machine: KV handles name loopback
        engine += ["--advertise-host", "127.0.0.1"]
    for flag, value in (
        ("--block-size", args.block_size),
        ("--num-blocks", args.num_blocks),
        ("--max-model-len", args.max_model_len),
    ):
        if value is not None:
            engine += [flag, str(value)]

    def metrics() -> list[str]:
        return ["--metrics-port", str(free_port(args.host))] if args.metrics else []

    grace = ["--drain-grace-s", str(args.drain_grace_s)]
    tls: list[str] = []  # every service serves TLS with the one certificate (serve_args.client_tls)
    if args.tls_cert_file:
        tls = [
            *("--tls-cert-file", str(Path(args.tls_cert_file).resolve())),
            *("--tls-key-file", str(Path(args.tls_key_file).resolve())),
        ]
    prefill = [
        launcher.add(
            f"prefill-{i}",
            "prefill-worker",
            [*engine, *prefill_at[i], *grace, *tls, *metrics()],
            SERVICES["prefill-worker"],
            host=args.host,
            env=env_of("prefill"),
        )
        for i in range(num_prefill)
    ]
    chunk = getattr(args, "prefill_chunk_tokens", None)
    decode_only = [] if chunk is None else ["--prefill-chunk-tokens", str(chunk)]
    decode = [
        launcher.add(
            f"decode-{i}",
            "decode-worker",
            [*engine, *decode_at[i], *decode_only, *grace, *tls, *metrics()],
            SERVICES["decode-worker"],
            host=args.host,
            env=env_of("decode"),
        )
        for i in range(num_decode)
    ]
    router_extra = [*common, *grace, *tls, *(access or []), *metrics()]
    if tls:  # the router dials its workers over TLS, trusting the CA that signed their certificate
        router_extra += ["--workers-tls-ca-file", str(Path(args.tls_ca_file).resolve())]
    if args.max_model_len is not None:
        router_extra += ["--max-model-len", str(args.max_model_len)]
    if args.colocated:
        router_extra.append("--colocated")
    if http_port is not None:
        router_extra += ["--http-port", str(http_port)]

    def router_args() -> list[str]:  # built at each launch: a relaunched worker has a new address
        return [
            *router_extra,
            *(a for w in prefill for a in ("--prefill", w.address)),
            *(a for w in decode for a in ("--decode", w.address)),
        ]

    launcher.add(
        "router",
        "router",
        router_args,
        SERVICES["router"],
        host=args.host,
        port=args.port or None,
        depends_on=(*prefill, *decode),
    )
