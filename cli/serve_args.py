"""`splitserve serve`'s flags and the checks on them before anything starts (cli/serve_cmd.py).

    add_arguments(parser)     every `serve` flag
    resolve_model(model)      --model as a checkpoint folder (default: the embedded tiny model)
    check_args(args)          (prefill workers, decode workers); the router's port is free
    client_tls(args)          the TLS `serve` and the router dial with (None: plaintext)
    check_http_port(args)     the router's OpenAI HTTP port (0: a free one), None for none

Each check raises ValueError with one line saying what to change.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from splitserve.cli import client
from splitserve.cli.arg_types import port

DEFAULT_HTTP_PORT = 8000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", metavar="DIR", help="checkpoint folder (default: the embedded tiny model)"
    )
    p.add_argument(
        "--num-prefill",
        type=int,
        default=None,
        help="prefill workers (default 1; 0 with --colocated)",
    )
    p.add_argument("--num-decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument(
        "--colocated",
        action="store_true",
        help="no prefill workers: each decode worker prefills its own prompts in its batch",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        metavar="N",
        help="decode workers' local-prefill tokens per step (colocated prompts, recompute), "
        "between decode steps (default 512; 0: each prompt whole in one step)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address every service binds (default 127.0.0.1)"
    )
    p.add_argument(
        "--port",
        type=port,
        default=client.DEFAULT_PORT,
        help=f"router gRPC port (default {client.DEFAULT_PORT}; 0 picks a free one)",
    )
    p.add_argument(
        "--http-port",
        type=port,
        default=None,
        help=f"router's OpenAI-compatible HTTP port (default {DEFAULT_HTTP_PORT}; a free one with --port 0; "
        "off with --prompt unless given)",
    )
    p.add_argument("--no-http", action="store_true", help="no OpenAI-compatible HTTP front")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (the workers' default: auto)")
    p.add_argument(
        "--mps",
        choices=["auto", "on", "off"],
        default="auto",
        help="when prefill and decode workers share a GPU, run them under NVIDIA MPS (joining a "
        "running control daemon or starting a private one) so their kernels overlap; auto: when "
        "MPS is installed, else they time-slice (default auto)",
    )
    p.add_argument(
        "--prefill-sm-share",
        type=int,
        default=50,
        metavar="PCT",
        help="under MPS, the prefill workers' share of the SMs in percent; decode takes the rest "
        "(default 50)",
    )
    p.add_argument(
        "--prefill-memory-share",
        type=int,
        default=30,
        metavar="PCT",
        help="under MPS, the memory a prefill worker may pin in percent of the GPU's (weights, "
        "KV pool, workspace); decode takes the rest (default 30)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="ranks per worker (each worker spawns its N-1 followers); on CUDA each worker gets its own "
        "GPUs: prefill workers from --device on, decode workers after them",
    )
    p.add_argument(
        "--prefill-tensor-parallel-size",
        type=int,
        metavar="N",
        help="ranks per prefill worker (default: --tensor-parallel-size)",
    )
    p.add_argument(
        "--decode-tensor-parallel-size",
        type=int,
        metavar="N",
        help="ranks per decode worker (default: --tensor-parallel-size)",
    )
    p.add_argument("--block-size", type=int, help="tokens per KV block (power of two)")
    p.add_argument(
        "--num-blocks",
        type=int,
        help="KV pool size in blocks per worker (default: from free memory)",
    )
    p.add_argument(
        "--max-model-len", type=int, help="longest prompt + output (default: the model's)"
    )
    p.add_argument(
        "--metrics",
        action="store_true",
        help="serve Prometheus /metrics of every service on a free port",
    )
    p.add_argument(
        "--log-dir",
        metavar="DIR",
        help="children's logs (default: a temporary folder, removed on a clean exit)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="children's log level",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every service (default 600)",
    )
    p.add_argument(
        "--drain-grace-s",
        type=float,
        default=10.0,
        help="seconds in-flight calls get to finish at shutdown, per stage (default 10, shorter "
        "than a service's own 30 s: a local Ctrl-C should not wait long)",
    )
    p.add_argument(
        "--prompt", help="answer this prompt once everything is healthy, print it, shut down"
    )
    g = p.add_argument_group(
        "TLS (docs/tls.md): every service serves TLS with one certificate, which must name the "
        "--host (127.0.0.1 on loopback) in its subjectAltName"
    )
    g.add_argument("--tls-cert-file", metavar="PEM", help="certificate chain of every service")
    g.add_argument("--tls-key-file", metavar="PEM", help="its private key")
    g.add_argument(
        "--tls-ca-file",
        metavar="PEM",
        help="the CA that signed it: the router and `serve` itself trust it",
    )
    a = p.add_argument_group(
        "API keys (docs/security.md): needed when --host is beyond loopback; `serve` itself uses "
        "the first key of --api-keys-file for --prompt"
    )
    a.add_argument(
        "--api-keys-file",
        metavar="FILE",
        help="the router's API keys, one per line; a missing file is created with one random key "
        "(as `splitserve keygen`)",
    )
    a.add_argument("--admin-keys-file", metavar="FILE", help="the router's admin keys")
    a.add_argument(
        "--no-api-key",
        action="store_true",
        help="serve without keys even beyond loopback (anyone who reaches the port may call)",
    )
    client.add_sampling_arguments(p, max_tokens=32)


def access_args(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The router's key flags, and the key `serve` sends itself (the first of --api-keys-file,
    created when missing; else $SPLITSERVE_API_KEY)."""
    from splitserve.cli.api_key import api_key_from_args
    from splitserve.cli.keygen_cmd import write_new_key

    flags: list[str] = []
    key = api_key_from_args(args)
    if args.api_keys_file:
        path = Path(args.api_keys_file).resolve()
        if write_new_key(path):
            print(f"splitserve serve: wrote a new API key to {path}", file=sys.stderr)
        flags += ["--api-keys-file", str(path)]
        from splitserve.service.credentials import load_keys

        key = (load_keys(str(path), None) or (key,))[0]
    if args.admin_keys_file:
        flags += ["--admin-keys-file", str(Path(args.admin_keys_file).resolve())]
    if args.no_api_key:
        flags.append("--no-api-key")
    _cluster_secret_for_children(args.host)
    return flags, key


def _cluster_secret_for_children(host: str) -> None:
    """Workers bound beyond loopback take calls only with the cluster secret: `serve` makes one
    for this run (the children inherit the environment) unless the user set their own."""
    import os
    import secrets

    from splitserve.service.credentials import (
        CLUSTER_SECRET_ENV,
        CLUSTER_SECRET_FILE_ENV,
        is_loopback_host,
    )

    if is_loopback_host(host) or CLUSTER_SECRET_ENV in os.environ:
        return
    if CLUSTER_SECRET_FILE_ENV not in os.environ:
        os.environ[CLUSTER_SECRET_ENV] = secrets.token_urlsafe(32)


def resolve_model(model: str | None) -> Path:
    if model is None:
        from splitserve.cli.tiny_model_cache import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"--model {model}: no such folder; give a checkpoint folder (config.json, *.safetensors, "
            "tokenizer.json) or leave --model out for the embedded tiny model"
        )
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ValueError(
            f"--model {model}: not a checkpoint folder (missing {', '.join(missing)}); "
            "`splitserve make-model DIR` writes one"
        )
    return path.resolve()


def check_args(args: argparse.Namespace) -> tuple[int, int]:
    num_prefill = (0 if args.colocated else 1) if args.num_prefill is None else args.num_prefill
    if args.colocated and num_prefill:
        raise ValueError("--colocated runs no prefill workers; leave --num-prefill out")
    if not args.colocated and num_prefill < 1:
        raise ValueError(f"--num-prefill must be >= 1, got {num_prefill} (or use --colocated)")
    if args.num_decode < 1:
        raise ValueError(f"--num-decode must be >= 1, got {args.num_decode}")
    if (args.prefill_chunk_tokens or 0) < 0:
        raise ValueError(
            f"--prefill-chunk-tokens must be >= 0 (0: whole prompts), got {args.prefill_chunk_tokens}"
        )
    if args.port and (why := _port_in_use(args.host, args.port)):
        raise ValueError(
            f"cannot use {args.host}:{args.port} for the router ({why}); another "
            "`splitserve serve` may run there: pass --port 0 for a free port"
        )
    return num_prefill, args.num_decode


def _port_in_use(host: str, port: int) -> str | None:
    """Why nothing can listen on host:port now, or None. SO_REUSEADDR, as gRPC's and the HTTP
    server's own sockets set it: a port whose last server just exited (its connections in
    TIME_WAIT) is free to them, while one a server listens on is not."""
    bind_host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def client_tls(args: argparse.Namespace):
    """TlsClientConfig trusting --tls-ca-file when the services serve TLS, else None; the three
    TLS flags go together (ValueError)."""
    given = [args.tls_cert_file, args.tls_key_file, args.tls_ca_file]
    if not any(given):
        return None
    if not all(given):
        raise ValueError(
            "--tls-cert-file, --tls-key-file and --tls-ca-file go together (the services dial "
            "each other, so they must trust the CA that signed the certificate)"
        )
    from splitserve.service.tls import TlsClientConfig

    return TlsClientConfig(ca_file=args.tls_ca_file)


def check_http_port(args: argparse.Namespace) -> int | None:
    """The router's HTTP port (0: pick a free one), None for no HTTP front."""
    if args.no_http or (args.prompt is not None and args.http_port is None):
        return None
    port = (
        args.http_port
        if args.http_port is not None
        else (0 if args.port == 0 else DEFAULT_HTTP_PORT)
    )
    if port and (why := _port_in_use(args.host, port)):
        raise ValueError(
            f"cannot use {args.host}:{port} for the OpenAI HTTP API ({why}); pass "
            "--http-port 0 for a free port, or --no-http"
        )
    return port
