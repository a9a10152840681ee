"""`splitserve decode-worker --model DIR`: serve the DecodeWorker gRPC API until SIGTERM.

Settings come from --config YAML (see decode_worker/config.py), then the flags below on top.
Also runnable alone: `python -m splitserve.cli.decode_worker_cmd --model DIR ...`.
"""

from __future__ import annotations

import argparse
import logging

from splitserve.engine.service_process import run_service_process
import sys

from splitserve.cli.arg_types import port

# flag dest -> dotted config field
_OVERRIDES = {
    "model": "engine.model_path",
    "device": "engine.device",
    "block_size": "engine.cache.block_size",
    "num_blocks": "engine.cache.num_blocks",
    "max_batch_size": "engine.scheduler.max_batch_size",
    "max_model_len": "engine.scheduler.max_model_len",
    "tensor_parallel_size": "engine.parallel.tensor_parallel_size",
    "stall_timeout_s": "engine.stall_timeout_s",
    "host": "server.host",
    "port": "server.port",
    "advertise_host": "server.advertise_host",
    "metrics_port": "server.metrics_port",
    "drain_grace_s": "server.drain_grace_s",
    "drain_announce_s": "server.drain_announce_s",
    "cuda_graph": "cuda_graph",
    "cuda_graph_sizes": "cuda_graph_sizes",
    "kv_failure_policy": "kv_transfer.failure_policy",
    "kv_data_timeout_s": "kv_transfer.data_timeout_s",
    "kv_connect_timeout_s": "kv_transfer.connect_timeout_s",
}


def _sizes(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes like 1,2,4,8,16, got {text!r}")


def register(sub) -> None:
    p = sub.add_parser("decode-worker", help="continue prefilled requests in a CUDA-graph decode batch")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="checkpoint folder (or engine.model_path in --config)")
    p.add_argument("--config", metavar="YAML", help="DecodeWorkerConfig file; flags override it")
    p.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=port, help="gRPC port (default 0: a free one, printed at start)")
    p.add_argument("--advertise-host", help="host the router dials (default: --host; bound to 0.0.0.0, this "
                                                  "machine's routable IP)")
    p.add_argument("--metrics-port", type=port, help="serve Prometheus /metrics on this port")
    p.add_argument("--max-batch-size", type=int, help="sequences decoded per step (default 256)")
    p.add_argument("--num-blocks", type=int, help="KV pool size in blocks (default: from free memory)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (power of two; as the prefill workers)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_const", const=False, default=None,
                   help="run every decode step eagerly (no CUDA graph capture)")
    p.add_argument("--cuda-graph-sizes", type=_sizes, metavar="N,N,...",
                   help="batch sizes to capture (default 1,2,4,8, then steps of 8 up to --max-batch-size)")
    p.add_argument("--drain-grace-s", type=float, help="seconds in-flight streams get to finish on SIGTERM")
    p.add_argument("--drain-announce-s", type=float,
                   help="seconds health says NOT_SERVING on SIGTERM before the port closes")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--tensor-parallel-size", type=int, metavar="N",
                   help="split the model over N ranks (processes; GPUs device..device+N-1), spawned by this one")
    p.add_argument("--kv-failure-policy", choices=["recompute", "fail"],
                   help="a failed KV pull: recompute the prompt here (default) or end with UNAVAILABLE")
    p.add_argument("--kv-connect-timeout-s", type=float, help="UCX connect timeout (default 5)")
    p.add_argument("--kv-data-timeout-s", type=float, help="KV payload receive timeout (default 30)")
    p.add_argument("--stall-timeout-s", type=float, metavar="S",
                   help="health NOT_SERVING while work waits and no engine step finished for S seconds (default 60)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def run(args: argparse.Namespace) -> int:
    from splitserve.decode_worker.config import load
    from splitserve.decode_worker.worker import run_worker

    if not args.model and not args.config:
        raise ValueError("give the checkpoint folder with --model DIR (or engine.model_path in --config)")
    cfg = load(args.config, {field: getattr(args, dest) for dest, field in _OVERRIDES.items()})
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_service_process(lambda: run_worker(cfg))


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (the launcher starts children this way)."""
    from splitserve.cli.standalone import standalone_main

    return standalone_main("decode-worker", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
