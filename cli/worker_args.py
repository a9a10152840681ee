"""The flags every worker command shares (`prefill-worker`, `decode-worker`), defined once.

Each flag maps to one dotted config field; a flag left out keeps the config file's value, and
the file's default is the model's default (documented once, in docs/configuration.md). A
worker command adds its own flags with `extra` and runs with `run_worker_command`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping
from typing import Any

from splitserve.cli.arg_types import port
from splitserve.service.tls_flags import SERVER_TLS_OVERRIDES, add_server_tls_arguments

# flag dest -> dotted config field, for the flags below
SHARED_OVERRIDES = {
    "model": "engine.model_path",
    "device": "engine.device",
    "block_size": "engine.cache.block_size",
    "num_blocks": "engine.cache.num_blocks",
    "max_num_batched_tokens": "engine.scheduler.max_num_batched_tokens",
    "max_model_len": "engine.scheduler.max_model_len",
    "tensor_parallel_size": "engine.parallel.tensor_parallel_size",
    "stall_timeout_s": "engine.stall_timeout_s",
    "host": "server.host",
    "port": "server.port",
    "advertise_host": "server.advertise_host",
    "metrics_port": "server.metrics_port",
    "drain_grace_s": "server.drain_grace_s",
    "drain_announce_s": "server.drain_announce_s",
    "open_to_all": "server.open_to_all",
    **SERVER_TLS_OVERRIDES,  # --tls-cert-file ... -> server.tls.*
}


def add_shared_arguments(p: argparse.ArgumentParser, config_name: str) -> None:
    p.add_argument(
        "--model", metavar="DIR", help="checkpoint folder (or engine.model_path in --config)"
    )
    p.add_argument("--config", metavar="YAML", help=f"{config_name} file; flags override it")
    p.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=port, help="gRPC port (default 0: a free one, printed at start)")
    p.add_argument(
        "--advertise-host",
        help="host the router (and decode workers, for KV) dial (default: --host; "
        "bound to 0.0.0.0, this machine's routable IP)",
    )
    p.add_argument("--metrics-port", type=port, help="serve Prometheus /metrics on this port")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    p.add_argument(
        "--block-size",
        type=int,
        help="tokens per KV block (power of two; the same on every worker)",
    )
    p.add_argument(
        "--num-blocks", type=int, help="KV pool size in blocks (default: from free memory)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="prompt tokens per step (longer prompts are chunked)",
    )
    p.add_argument(
        "--max-model-len", type=int, help="longest prompt + output (default: the model's)"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="split the model over N ranks (processes; GPUs device..device+N-1), spawned by this one",
    )
    p.add_argument(
        "--drain-grace-s", type=float, help="seconds in-flight calls get to finish on SIGTERM"
    )
    p.add_argument(
        "--drain-announce-s",
        type=float,
        help="seconds health says NOT_SERVING on SIGTERM before the port closes",
    )
    p.add_argument(
        "--stall-timeout-s",
        type=float,
        metavar="S",
        help="health NOT_SERVING while work waits and no engine step finished for S seconds",
    )
    add_server_tls_arguments(p)
    p.add_argument(
        "--open-to-all",
        action="store_true",
        default=None,
        help="beyond loopback, serve callers without the cluster secret "
        "($SPLITSERVE_CLUSTER_SECRET, docs/security.md); refused by default",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def config_overrides(args: argparse.Namespace, overrides: Mapping[str, str]) -> dict[str, Any]:
    """Dotted config field -> flag value, for the shared flags and a command's own `overrides`."""
    return {field: getattr(args, dest) for dest, field in {**SHARED_OVERRIDES, **overrides}.items()}


def run_worker_command(
    args: argparse.Namespace,
    overrides: Mapping[str, str],
    load: Callable[[str | None, dict[str, Any]], Any],
    serve: Callable[[Any], Any],
) -> int:
    """Config from --config + flags (`overrides`: this command's own flag -> field), logging,
    then the worker until SIGTERM (`serve(cfg)`: a coroutine function)."""
    from splitserve.service.service_process import run_service_process

    if not args.model and not args.config:
        raise ValueError(
            "give the checkpoint folder with --model DIR (or engine.model_path in --config)"
        )
    cfg = load(args.config, config_overrides(args, overrides))
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_service_process(lambda: serve(cfg))
