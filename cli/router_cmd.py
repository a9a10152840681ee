"""`splitserve router --model DIR --prefill ADDR --decode ADDR`: serve the public GenerateService
(and RouterControl for worker registration) until SIGTERM. `--colocated --decode ADDR`: no
prefill workers; each decode worker computes the prompt itself (the comparison mode).

Settings come from --config YAML (see router/config.py), then the flags below on top.
Also runnable alone: `python -m splitserve.cli.router_cmd --model DIR ...`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from splitserve.cli.arg_types import port
from splitserve.service.service_process import run_service_process
from splitserve.service.tls_flags import SERVER_TLS_OVERRIDES, add_server_tls_arguments

# flag dest -> dotted config field
_OVERRIDES = {
    "model": "model_path",
    "model_name": "model_name",
    "max_model_len": "max_model_len",
    "host": "server.host",
    "port": "server.port",
    "advertise_host": "server.advertise_host",
    "metrics_port": "server.metrics_port",
    "http_port": "http.port",
    "drain_grace_s": "server.drain_grace_s",
    "drain_announce_s": "server.drain_announce_s",
    "prefill": "workers.prefill",
    "decode": "workers.decode",
    "colocated": "routing.colocated",
    "prefill_policy": "routing.prefill_policy",
    "decode_policy": "routing.decode_policy",
    "poll_interval_s": "registry.poll_interval_s",
    **SERVER_TLS_OVERRIDES,  # --tls-cert-file ... -> server.tls.* (also the HTTP front's)
    "workers_tls_ca_file": "workers_tls.ca_file",
    "workers_tls_cert_file": "workers_tls.cert_file",
    "workers_tls_key_file": "workers_tls.key_file",
    "api_keys_file": "auth.api_keys_file",
    "admin_keys_file": "auth.admin_keys_file",
    "cluster_secret_file": "auth.cluster_secret_file",
    "require_api_key": "auth.require_api_key",
    "control_host": "control.host",
    "control_port": "control.port",
}
POLICIES = ("round_robin", "least_loaded", "prefix_aware")


def _policy(text: str) -> str:
    name = text.replace("-", "_")
    if name not in POLICIES:
        raise argparse.ArgumentTypeError(
            f"unknown policy {text!r}; choose round-robin, least-loaded or prefix-aware"
        )
    return name


def register(sub) -> None:
    p = sub.add_parser(
        "router", help="serve the public Generate API over prefill and decode workers"
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="DIR",
        help="checkpoint folder: tokenizer.json and config.json (no weights read)",
    )
    p.add_argument("--config", metavar="YAML", help="RouterConfig file; flags override it")
    p.add_argument(
        "--model-name", help="model name reported by GetServerInfo (default: the folder name)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="longest prompt + output (default: the model's); as the workers'",
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=port, help="gRPC port (default 0: a free one, printed at start)")
    p.add_argument(
        "--advertise-host",
        help="host that clients and workers use to reach this one (default: "
        "--host; bound to 0.0.0.0, this machine's routable IP)",
    )
    p.add_argument("--metrics-port", type=port, help="serve Prometheus /metrics on this port")
    p.add_argument(
        "--http-port",
        type=port,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, ...) on this port (0: a free one; "
        "default: off)",
    )
    p.add_argument(
        "--drain-grace-s", type=float, help="seconds in-flight streams get to finish on SIGTERM"
    )
    p.add_argument(
        "--drain-announce-s",
        type=float,
        help="seconds health says NOT_SERVING on SIGTERM before the port closes",
    )
    p.add_argument(
        "--prefill",
        action="append",
        metavar="HOST:PORT",
        help="a prefill worker (repeat for several; more may register over RouterControl)",
    )
    p.add_argument(
        "--decode",
        action="append",
        metavar="HOST:PORT",
        help="a decode worker (repeat for several)",
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        default=None,
        help="no prefill workers: decode workers compute the prompt and decode in one batch loop "
        "(to compare against disaggregated serving); refused together with --prefill",
    )
    p.add_argument(
        "--prefill-policy",
        type=_policy,
        metavar="POLICY",
        help="prefix-aware (default), least-loaded or round-robin",
    )
    p.add_argument(
        "--decode-policy",
        type=_policy,
        metavar="POLICY",
        help="least-loaded (default) or round-robin",
    )
    p.add_argument(
        "--poll-interval-s", type=float, help="seconds between health/load probes of each worker"
    )
    add_access_arguments(p)
    add_tls_arguments(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """The router's own certificate (server.tls) and its TLS to the workers (workers_tls)."""
    add_server_tls_arguments(p)
    g = p.add_argument_group("TLS to the workers (docs/tls.md; or workers_tls in --config)")
    g.add_argument(
        "--workers-tls-ca-file", metavar="PEM", help="call workers over TLS, trusting this CA"
    )
    g.add_argument(
        "--workers-tls-cert-file",
        metavar="PEM",
        help="present this certificate to workers that require mutual TLS",
    )
    g.add_argument("--workers-tls-key-file", metavar="PEM", help="its private key")


def add_access_arguments(p: argparse.ArgumentParser) -> None:
    """Keys, the cluster secret and the control listener (docs/security.md)."""
    p.add_argument(
        "--api-keys-file",
        metavar="FILE",
        help="API keys, one per line (also $SPLITSERVE_API_KEYS); required off loopback",
    )
    p.add_argument(
        "--admin-keys-file",
        metavar="FILE",
        help="admin keys (also $SPLITSERVE_ADMIN_KEYS): see worker addresses, abort any request",
    )
    p.add_argument(
        "--cluster-secret-file",
        metavar="FILE",
        help="secret workers present to register (also $SPLITSERVE_CLUSTER_SECRET)",
    )
    p.add_argument(
        "--no-api-key",
        dest="require_api_key",
        action="store_const",
        const=False,
        help="serve without API keys even beyond loopback (anyone who reaches the port may call)",
    )
    p.add_argument("--control-host", help="address of the private control listener")
    p.add_argument(
        "--control-port",
        type=port,
        help="serve RouterControl (worker registration) on this port only, not the public one",
    )


def run(args: argparse.Namespace) -> int:
    from splitserve.router.config import RouterConfig
    from splitserve.router.server import run_router

    if not args.model and not args.config:
        raise ValueError("give the checkpoint folder with --model DIR (or model_path in --config)")
    cfg = RouterConfig.load(
        args.config, {field: getattr(args, dest) for dest, field in _OVERRIDES.items()}
    )
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_service_process(lambda: run_router(cfg))


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (the launcher starts children this way)."""
    from splitserve.cli.standalone import standalone_main

    return standalone_main("router", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
