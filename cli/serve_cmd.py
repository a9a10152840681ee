"""`splitserve serve`: a router, N prefill and M decode workers as child processes on loopback.

    splitserve serve                          # embedded tiny model, router on 127.0.0.1:50051
    splitserve serve --model DIR --num-decode 2 --device cuda
    splitserve serve --prompt "Hello"         # start, answer one prompt, print it, shut down
    splitserve serve --colocated              # one decode worker that also prefills (no KV hand-off)
    splitserve serve --device cuda --prefill-tensor-parallel-size 2 --decode-tensor-parallel-size 1
                                              # prefill on cuda:0-1, decode on cuda:2 (serve_placement.py)

Each child gets a free port and a log file (--log-dir); `serve` waits until every child's
grpc.health.v1 says SERVING, prints `ready: router on HOST:PORT (...); OpenAI API on
http://HOST:HTTP_PORT/v1` on stdout (the router's OpenAI-compatible HTTP front: --http-port,
default 8000, a free one with --port 0, off with --no-http or --prompt), and on
Ctrl-C / SIGTERM stops the router (it drains its streams), then the workers, killing any
straggler. A child that fails to start ends `serve` with one line naming it and its last log
lines. Also runnable alone: `python -m splitserve.cli.serve_cmd ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from splitserve.cli import client
from splitserve.cli.arg_types import port
from splitserve.cli.launcher import Launcher, StartError, free_port
from splitserve.cli.serve_placement import worker_flags
from splitserve.service.net import is_wildcard, local_dial_host

DEFAULT_HTTP_PORT = 8000
SERVICES = {
    "prefill-worker": "splitserve.v1.PrefillWorker",
    "decode-worker": "splitserve.v1.DecodeWorker",
    "router": "splitserve.v1.GenerateService",
}


def register(sub) -> None:
    p = sub.add_parser(
        "serve", help="start a router + prefill + decode workers locally (or answer one --prompt)"
    )
    add_arguments(p)
    p.set_defaults(func=run)


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
        help="seconds in-flight streams get to finish at shutdown, per stage (default 10)",
    )
    p.add_argument(
        "--prompt", help="answer this prompt once everything is healthy, print it, shut down"
    )
    client.add_sampling_arguments(p, max_tokens=32)


# ---- checks before anything starts --------------------------------------------------------------
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
    if args.port:
        with socket.socket() as s:
            try:
                s.bind((args.host, args.port))
            except OSError as exc:
                raise ValueError(
                    f"cannot use {args.host}:{args.port} for the router ({exc.strerror}); another "
                    "`splitserve serve` may run there: pass --port 0 for a free port"
                ) from None
    return num_prefill, args.num_decode


def check_http_port(args: argparse.Namespace) -> int | None:
    """The router's HTTP port (0: pick a free one), None for no HTTP front."""
    if args.no_http or (args.prompt is not None and args.http_port is None):
        return None
    port = (
        args.http_port
        if args.http_port is not None
        else (0 if args.port == 0 else DEFAULT_HTTP_PORT)
    )
    if port:
        with socket.socket() as s:
            try:
                s.bind((args.host, port))
            except OSError as exc:
                raise ValueError(
                    f"cannot use {args.host}:{port} for the OpenAI HTTP API ({exc.strerror}); pass "
                    "--http-port 0 for a free port, or --no-http"
                ) from None
    return port


def display_host(host: str) -> str:
    return local_dial_host(host)


# ---- the services ---------------------------------------------------------------------------------
def build(
    launcher: Launcher,
    args: argparse.Namespace,
    model: Path,
    num_prefill: int,
    num_decode: int,
    http_port: int | None = None,
    placement: tuple[list[list[str]], list[list[str]]] | None = None,
) -> None:
    """`placement`: serve_placement.worker_flags (computed here when None)."""
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
    prefill = [
        launcher.add(
            f"prefill-{i}",
            "prefill-worker",
            [*engine, *prefill_at[i], *metrics()],
            SERVICES["prefill-worker"],
            host=args.host,
        )
        for i in range(num_prefill)
    ]
    decode = [
        launcher.add(
            f"decode-{i}",
            "decode-worker",
            [*engine, *decode_at[i], *grace, *metrics()],
            SERVICES["decode-worker"],
            host=args.host,
        )
        for i in range(num_decode)
    ]
    router_extra = [*common, *grace, *metrics()]
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


def _metrics_of(child) -> str:
    args = child.args() if callable(child.args) else child.args
    if "--metrics-port" in args:
        return f", metrics http://{child.host}:{args[args.index('--metrics-port') + 1]}/metrics"
    return ""


def wait_ready(launcher: Launcher, args: argparse.Namespace, stop: threading.Event) -> None:
    from tqdm import tqdm

    t0 = time.monotonic()
    with tqdm(
        total=len(launcher.children),
        desc="starting services",
        unit="svc",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    ) as bar:

        def healthy(child) -> None:
            bar.write(
                f"  {child.name:<10} healthy on {child.address} after {time.monotonic() - t0:.1f}s "
                f"(pid {child.pid}{_metrics_of(child)})",
                file=sys.stderr,
            )
            bar.update(1)
            bar.set_postfix_str(
                "waiting: " + ", ".join(c.name for c in launcher.children if not c.healthy)
            )

        bar.set_postfix_str("waiting: " + ", ".join(c.name for c in launcher.children))
        launcher.wait_healthy(args.start_timeout, stop, on_healthy=healthy, on_poll=bar.refresh)


def run(args: argparse.Namespace) -> int:
    num_prefill, num_decode = check_args(args)
    placement = worker_flags(
        args, num_prefill, num_decode
    )  # too few GPUs: refused before anything starts
    http_port = check_http_port(args)
    if http_port == 0:
        http_port = free_port(args.host)
    model = resolve_model(args.model)
    auto_logs = args.log_dir is None
    log_dir = (
        Path(tempfile.mkdtemp(prefix="splitserve-serve-")) if auto_logs else Path(args.log_dir)
    )
    launcher = Launcher(
        log_dir, on_event=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)
    )
    build(launcher, args, model, num_prefill, num_decode, http_port, placement)
    router = launcher.children[-1]
    what = "colocated" if args.colocated else f"{num_prefill} prefill"
    print(
        f"splitserve serve: {what} + {num_decode} decode worker(s) + router on model {model} "
        f"(logs in {log_dir})",
        file=sys.stderr,
        flush=True,
    )

    stop = threading.Event()
    interrupt = [False]  # raise KeyboardInterrupt on a signal (while --prompt streams)

    def on_signal(*_) -> None:
        stop.set()
        if interrupt[0]:
            interrupt[0] = False
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    error, code = None, 0
    try:
        launcher.start_all()
        wait_ready(launcher, args, stop)
        if args.prompt is not None:
            print(
                f"splitserve serve: ready on {router.address}; answering --prompt",
                file=sys.stderr,
                flush=True,
            )
            interrupt[0] = True
            client.stream_to(sys.stdout, router.address, args.prompt, args)
            interrupt[0] = False
        else:
            http = (
                f"http://{display_host(args.host)}:{http_port}/v1"
                if http_port is not None
                else None
            )
            print(
                f"ready: router on {router.address} ({what}, {num_decode} decode, model {model.name})"
                + (f"; OpenAI API on {http}" if http else ""),
                flush=True,
            )
            print(
                f'  try: splitserve generate "Hello" --address {router.address}   (Ctrl-C stops everything)',
                file=sys.stderr,
                flush=True,
            )
            if http:
                print(
                    f'       curl {http}/completions -d \'{{"prompt": "Hello", "max_tokens": 16}}\'',
                    file=sys.stderr,
                    flush=True,
                )
            while not stop.wait(0.5):
                launcher.check_alive()
    except (StartError, client.GenerateError) as exc:
        error, code = str(exc), 1
    except KeyboardInterrupt:  # a signal before everything was ready, or during --prompt
        code = 130
    finally:
        print("splitserve serve: stopping services", file=sys.stderr, flush=True)
        exits = launcher.stop(args.drain_grace_s + 5.0)
        for s, handler in previous.items():
            signal.signal(s, handler)
    unclean = [
        f"{n} (exit {c}, log {log_dir / n}.log)" for n, c in exits.items() if c not in (0, None)
    ]
    if error is None and unclean and code == 0:
        error, code = f"did not stop cleanly: {', '.join(unclean)}", 1
    if error is not None:  # last, so that it is the line the user sees
        print(f"splitserve serve: error: {error}", file=sys.stderr, flush=True)
    else:
        print(
            f"splitserve serve: {'interrupted; ' if code == 130 else ''}stopped",
            file=sys.stderr,
            flush=True,
        )
    if auto_logs and code == 0:
        with contextlib.suppress(OSError):
            shutil.rmtree(log_dir)
    return code


def main(argv: list[str] | None = None) -> int:
    from splitserve.cli.standalone import standalone_main

    return standalone_main("serve", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
