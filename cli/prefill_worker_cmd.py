"""`splitserve prefill-worker --model DIR`: serve the PrefillWorker gRPC API until SIGTERM.

Settings come from --config YAML (see prefill_worker/config.py), then the flags below on top.
"""

from __future__ import annotations

import argparse
import logging

from splitserve.engine.service_process import run_service_process

from splitserve.cli.arg_types import port

# flag dest -> dotted config field
_OVERRIDES = {
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
    "lease_ttl_s": "lease_ttl_s",
}


def register(sub) -> None:
    p = sub.add_parser("prefill-worker", help="serve prompts (context-only) and hand their KV to decode workers")
    p.add_argument("--model", metavar="DIR", help="checkpoint folder (or engine.model_path in --config)")
    p.add_argument("--config", metavar="YAML", help="PrefillWorkerConfig file; flags override it")
    p.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=port, help="gRPC port (default 0: a free one, printed at start)")
    p.add_argument("--advertise-host", help="host the router and decode workers dial, also for the KV (UCX) "
                                                  "listener (default: --host; bound to 0.0.0.0, the routable IP)")
    p.add_argument("--metrics-port", type=port, help="serve Prometheus /metrics on this port")
    p.add_argument("--block-size", type=int, help="tokens per KV block (power of two)")
    p.add_argument("--num-blocks", type=int, help="KV pool size in blocks (default: from free memory)")
    p.add_argument("--max-num-batched-tokens", type=int, help="prompt tokens per step (longer prompts are chunked)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    p.add_argument("--lease-ttl-s", type=float, help="seconds finished KV stays pinned for the decode side")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--tensor-parallel-size", type=int, metavar="N",
                   help="split the model over N ranks (processes; GPUs device..device+N-1), spawned by this one")
    p.add_argument("--stall-timeout-s", type=float, metavar="S",
                   help="health NOT_SERVING while work waits and no engine step finished for S seconds (default 60)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from splitserve.prefill_worker.config import PrefillWorkerConfig
    from splitserve.prefill_worker.worker import run_worker

    if not args.model and not args.config:
        raise ValueError("give the checkpoint folder with --model DIR (or engine.model_path in --config)")
    cfg = PrefillWorkerConfig.load(args.config, {field: getattr(args, dest) for dest, field in _OVERRIDES.items()})
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_service_process(lambda: run_worker(cfg))
