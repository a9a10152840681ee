"""`splitserve serve`: a router, N prefill and M decode workers as child processes on loopback.

    splitserve serve                          # embedded tiny model, router on 127.0.0.1:50051
    splitserve serve --model DIR --num-decode 2 --device cuda
    splitserve serve --prompt "Hello"         # start, answer one prompt, print it, shut down
    splitserve serve --colocated              # one decode worker that also prefills (no KV hand-off)
    splitserve serve --tls-cert-file cert.pem --tls-key-file key.pem --tls-ca-file ca.pem
                                              # every service over TLS (docs/tls.md)
    splitserve serve --device cuda --prefill-tensor-parallel-size 2 --decode-tensor-parallel-size 1
                                              # prefill on cuda:0-1, decode on cuda:2 (serve_placement.py)

Each child gets a free port and a log file (--log-dir); `serve` waits until every child's
grpc.health.v1 says SERVING, prints `ready: router on HOST:PORT (...); OpenAI API on
http://HOST:HTTP_PORT/v1` on stdout (the router's OpenAI-compatible HTTP front: --http-port,
default 8000, a free one with --port 0, off with --no-http or --prompt), and on
Ctrl-C / SIGTERM stops the router (it drains its streams), then the workers, killing any
straggler. A child that fails to start ends `serve` with one line naming it and its last log
lines. Also runnable alone: `python -m splitserve.cli.serve_cmd ...`. The flags and their
checks: cli/serve_args.py; the children and their argv: cli/serve_children.py.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from splitserve.cli import client
from splitserve.cli.launcher import Launcher, StartError
from splitserve.cli.serve_args import (
    access_args,
    add_arguments,
    check_args,
    check_http_port,
    client_tls,
    resolve_model,
)
from splitserve.cli.serve_children import build
from splitserve.cli.serve_mps import plan_mps, start_mps
from splitserve.cli.serve_placement import worker_flags
from splitserve.service.net import free_port, local_dial_host
from splitserve.service.service_process import end_with_exit_now


def register(sub) -> None:
    p = sub.add_parser(
        "serve", help="start a router + prefill + decode workers locally (or answer one --prompt)"
    )
    add_arguments(p)
    p.set_defaults(func=run)


def display_host(host: str) -> str:
    return local_dial_host(host)


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
    tls = client_tls(args)
    access, api_key = access_args(args)
    if http_port == 0:
        http_port = free_port(args.host)
    mps, why_not_mps = plan_mps(args, *placement)  # bad shares: refused before anything starts
    model = resolve_model(args.model)
    auto_logs = args.log_dir is None
    log_dir = (
        Path(tempfile.mkdtemp(prefix="splitserve-serve-")) if auto_logs else Path(args.log_dir)
    )
    end_with_exit_now()  # once children exist: gRPC's thread shutdown at exit must not hang it
    say = lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)  # noqa: E731
    launcher = Launcher(log_dir, on_event=say, tls=tls)
    if why_not_mps:
        say(why_not_mps)
    try:
        mps = start_mps(mps, args.mps, say)  # --mps auto: time-slices if its daemon won't start
    except RuntimeError:
        if auto_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        raise
    try:
        build(
            launcher, args, model, num_prefill, num_decode, http_port, placement, access,
            worker_env=mps.env if mps is not None else None,
        )  # fmt: skip
    except BaseException:
        if mps is not None:
            mps.stop()
        raise
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
            client.stream_to(
                sys.stdout, router.address, args.prompt, args, tls=tls, api_key=api_key
            )
            interrupt[0] = False
        else:
            scheme = "https" if tls is not None else "http"
            http = (
                f"{scheme}://{display_host(args.host)}:{http_port}/v1"
                if http_port is not None
                else None
            )
            # how a client trusts the services' certificate (docs/tls.md)
            ca = f" --tls-ca-file {args.tls_ca_file}" if tls is not None else ""
            cacert = f" --cacert {args.tls_ca_file}" if tls is not None else ""
            if args.api_keys_file:  # the key stays in its file, out of the terminal's history
                ca += f' --api-key "$(head -1 {args.api_keys_file})"'
                cacert += f' -H "Authorization: Bearer $(head -1 {args.api_keys_file})"'
            print(
                f"ready: router on {router.address} ({what}, {num_decode} decode, model {model.name})"
                + (f"; OpenAI API on {http}" if http else ""),
                flush=True,
            )
            print(
                f'  try: splitserve generate "Hello" --address {router.address}{ca}   '
                "(Ctrl-C stops everything)",
                file=sys.stderr,
                flush=True,
            )
            if http:
                print(
                    f"       curl{cacert} {http}/completions "
                    + '-d \'{"prompt": "Hello", "max_tokens": 16}\'',
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
        if mps is not None:  # after its clients: a private daemon quits once they are gone
            mps.stop()
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
