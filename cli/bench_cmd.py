"""`splitserve bench`: a serving benchmark against a running router, in the manner of
`vllm bench serve`.

    splitserve bench --num-prompts 200 --input-len 512 --output-len 128 --request-rate 8 \\
        --slo ttft:500,tpot:50 --json-out bench.json --plot bench.png

Prompts are random token ids of --input-len (or --dataset FILE.jsonl); every request asks for
--output-len tokens with ignore_eos, so outputs have that length. Requests arrive as a Poisson
process at --request-rate (inf: all at once), at most --max-concurrency in flight. The summary
gives request and token throughput, TTFT / TPOT / ITL / E2E latency (mean, median, p90, p99)
and goodput under --slo. `--backend openai` sends the same requests as streamed /v1/completions
to an OpenAI-compatible HTTP API (`--base-url`, default $OPENAI_BASE_URL, else
http://127.0.0.1:8000/v1: `splitserve serve`'s), timed the same way. A router with API keys
(docs/security.md) takes `--api-key` (default $SPLITSERVE_API_KEY; openai: else $OPENAI_API_KEY).
Also runnable alone: `python -m splitserve.cli.bench_cmd ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from splitserve.cli import client
from splitserve.cli.api_key import add_api_key_argument, api_key_from_args
from splitserve.cli.bench.workload import parse_slo
from splitserve.service.tls_flags import add_client_tls_arguments, client_tls_from_args


def register(sub) -> None:
    p = sub.add_parser("bench", help="serving benchmark: throughput, TTFT/TPOT/ITL/E2E, goodput")
    add_arguments(p)
    p.set_defaults(func=run)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected requests per second or inf, got {text!r}"
        ) from None
    return value


DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=("grpc", "openai"),
        default="grpc",
        help="grpc: the router's Generate (default); openai: streamed /v1/completions over HTTP",
    )
    p.add_argument(
        "--address",
        metavar="HOST:PORT",
        help=f"router address (default ${client.ADDRESS_ENV}, else 127.0.0.1:{client.DEFAULT_PORT})",
    )
    p.add_argument(
        "--base-url",
        metavar="URL",
        help=f"--backend openai: the API's base URL (default $OPENAI_BASE_URL, else {DEFAULT_BASE_URL})",
    )
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    p.add_argument(
        "--dataset",
        metavar="FILE.jsonl",
        help='prompts, one JSON object a line: {"prompt": TEXT} or {"prompt_token_ids": [...]}',
    )
    p.add_argument(
        "--traffic",
        choices=("random", "realistic"),
        default=None,
        help="random: --input-len random ids, --temperature for all (default); realistic: a "
        "seeded mix shaped like public chat and coding traces, long-tailed lengths, multi-turn "
        "prefixes, per-request sampling (70%% top-p 0.95, 20%% greedy, 10%% seeded + penalties)",
    )
    p.add_argument(
        "--traffic-out",
        metavar="FILE.jsonl",
        help="write the requests sent (ids, output_len, sampling) as JSONL; replay with --dataset",
    )
    p.add_argument(
        "--save-outputs",
        action="store_true",
        help="--json-out keeps each request's output: token ids (gRPC) or text (openai)",
    )
    p.add_argument(
        "--input-len", type=int, default=128, help="random prompt length in tokens (default 128)"
    )
    p.add_argument("--output-len", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument(
        "--request-rate",
        type=_rate,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)"
    )
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)"
    )
    p.add_argument("--no-ignore-eos", action="store_true", help="let EOS end a request early")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    p.add_argument(
        "--num-warmups", type=int, default=1, help="unmeasured requests sent first (default 1)"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="deadline of each request in seconds"
    )
    p.add_argument(
        "--slo",
        type=parse_slo,
        metavar="KEY:MS,...",
        help="service-level objectives for goodput, e.g. ttft:500,tpot:50 (keys ttft tpot itl e2el)",
    )
    p.add_argument(
        "--json-out", metavar="FILE", help="write the summary and per-request rows as JSON"
    )
    p.add_argument("--plot", metavar="FILE.png", help="plot the latency CDFs (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_api_key_argument(p, openai=True)
    add_client_tls_arguments(p)  # gRPC channel; --backend openai: whom https:// trusts


def _announce(cfg, model: str, workers: dict[str, int]) -> None:
    print(
        f"bench: {cfg.num_prompts} requests to {cfg.address} over {cfg.backend} ({model}; "
        f"{workers.get('prefill', 0)} prefill + {workers.get('decode', 0)} decode healthy), rate "
        f"{cfg.request_rate:g}/s, max concurrency {cfg.max_concurrency or 'none'}",
        file=sys.stderr,
        flush=True,
    )


def _keep_traffic(cfg, prompts) -> dict | None:
    """--traffic realistic: says the mix and returns it (for --json-out); --traffic-out writes
    the requests."""
    from splitserve.cli.bench.workload import write_jsonl

    if cfg.traffic == "realistic":
        from splitserve.cli.bench.traffic import describe

        mix = describe(prompts)
        print(
            f"bench: realistic traffic: {mix['kinds']}, sampling {mix['sampling']}, prompt "
            f"p50/p99 {mix['prompt_len']['p50']:.0f}/{mix['prompt_len']['p99']:.0f}, output "
            f"p50/p99 {mix['output_len']['p50']:.0f}/{mix['output_len']['p99']:.0f} tokens",
            file=sys.stderr,
        )
    if cfg.traffic_out:
        write_jsonl(cfg.traffic_out, prompts)
        print(f"wrote {cfg.traffic_out}", file=sys.stderr)
    return mix if cfg.traffic == "realistic" else None


async def _run_grpc(cfg, progress, tls, api_key) -> tuple[dict, list, float]:
    from splitserve.cli.api_key import grpc_interceptors
    from splitserve.cli.bench import runner
    from splitserve.cli.bench.traffic import bench_prompts
    from splitserve.cli.bench.workload import arrival_offsets
    from splitserve.protos import generate_pb2_grpc
    from splitserve.service.grpc_service import channel_options
    from splitserve.service.tls import open_channel

    # the key goes with every call on the channel (GetServerInfo, Generate)
    async with open_channel(
        cfg.address, tls, channel_options(), interceptors=grpc_interceptors(api_key)
    ) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        info = await runner.server_info(stub, cfg.address)
        prompts = bench_prompts(cfg, info.vocab_size, info.max_model_len)
        runner.check_lengths(prompts, info.max_model_len)
        mix = _keep_traffic(cfg, prompts)
        offsets = arrival_offsets(cfg.num_prompts, cfg.request_rate, cfg.burstiness, cfg.seed)
        workers = {"prefill": 0, "decode": 0}
        for w in info.workers:
            workers["prefill" if w.role == 1 else "decode"] += int(w.healthy)
        _announce(cfg, info.model_name, workers)
        await runner.warm_up(stub, cfg, prompts)
        with progress() as bar:
            results, duration = await runner.run_requests(
                stub, cfg, prompts, offsets, on_done=lambda r: bar.update(1)
            )
    server = {
        "address": cfg.address,
        "traffic": mix,
        "model_name": info.model_name,
        "max_model_len": info.max_model_len,
        "block_size": info.block_size,
        "healthy_workers": workers,
    }
    return server, results, duration


async def _run_openai(cfg, progress, tls, api_key) -> tuple[dict, list, float]:
    from splitserve.cli.bench import openai_runner, runner
    from splitserve.cli.bench.traffic import bench_prompts
    from splitserve.cli.bench.workload import arrival_offsets
    from splitserve.service.tls import client_ssl_context

    ssl_context = client_ssl_context(tls) if tls is not None else None
    api = await openai_runner.OpenAIClient.connect(cfg.address, ssl_context, api_key)
    try:
        if api.vocab_size is None and cfg.dataset is None:
            raise runner.BenchError(
                f"{cfg.address}/models does not give vocab_size, which random prompts need; "
                "pass --dataset FILE.jsonl"
            )
        prompts = bench_prompts(cfg, api.vocab_size or 0, api.max_model_len)
        mix = _keep_traffic(cfg, prompts)
        if api.max_model_len:
            runner.check_lengths(prompts, api.max_model_len)
        offsets = arrival_offsets(cfg.num_prompts, cfg.request_rate, cfg.burstiness, cfg.seed)
        _announce(cfg, api.model, api.workers)
        await runner.warm_up(api, cfg, prompts, send=openai_runner.send_one)
        with progress() as bar:
            results, duration = await runner.run_requests(
                api,
                cfg,
                prompts,
                offsets,
                on_done=lambda r: bar.update(1),
                send=openai_runner.send_one,
            )
    finally:
        await api.close()
    server = {
        "address": cfg.address,
        "traffic": mix,
        "model_name": api.model,
        "max_model_len": api.max_model_len,
        "healthy_workers": api.workers,
    }
    return server, results, duration


async def _bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from splitserve.cli.bench import metrics, report
    from splitserve.cli.bench.workload import BenchConfig

    if args.backend == "openai":
        address = args.base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    else:
        address = args.address or client.default_address()
    cfg = BenchConfig.from_args(args, address)
    if args.plot:
        from splitserve.cli.bench.plot import require_matplotlib

        require_matplotlib()

    def progress():
        return tqdm(
            total=cfg.num_prompts,
            desc="requests",
            unit="req",
            file=sys.stderr,
            disable=args.no_progress or None,
        )

    run = _run_openai if cfg.backend == "openai" else _run_grpc
    # the key stays out of cfg: cfg goes into --json-out
    api_key = api_key_from_args(args, openai=cfg.backend == "openai")
    server, results, duration = await run(cfg, progress, client_tls_from_args(args), api_key)
    model_name = server["model_name"]
    summary = metrics.summarize(results, duration, cfg.slo)
    report.print_summary(sys.stdout, summary, cfg, model_name)
    if args.json_out:
        report.write_json(args.json_out, summary, cfg, server, metrics.per_request(results))
        print(f"wrote {args.json_out}", file=sys.stderr)
    if args.plot:
        from splitserve.cli.bench.plot import plot_cdfs

        plot_cdfs(
            args.plot,
            metrics.latency_samples(results),
            f"splitserve bench: {model_name}, {cfg.num_prompts} req, rate {cfg.request_rate:g}/s",
        )
        print(f"wrote {args.plot}", file=sys.stderr)
    if summary["completed"] == 0:
        first = next((r.error for r in results if r.error), "no request completed")
        print(
            f"splitserve bench: error: every request failed; first error: {first}", file=sys.stderr
        )
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_bench(args))


def main(argv: list[str] | None = None) -> int:
    from splitserve.cli.standalone import standalone_main

    return standalone_main("bench", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
