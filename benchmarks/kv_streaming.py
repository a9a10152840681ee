"""Exposed KV hand-over time: from the end of the prefill's compute to the decode side holding
the whole KV and the first token (able to run its first step), streaming on and off.

Two processes on one host (cuda_ipc on one GPU where UCX picks it; TCP loopback on CPU): the
prefill side runs the real PrefillEngine with its UCX listener (streamed pulls attached as in
the prefill worker), the decode side a KV pool with the real clients.

    streaming on:  the decode side asks for the streamed pull before the prefill starts (as the
                   router launches Decode with Prefill); exposed = last piece landed - compute end
    streaming off: the handle goes prefill -> this process -> decode side (the router's hop),
                   then the classic pull; exposed = pull landed - compute end

Both ends read the same monotonic clock (perf_counter, CLOCK_MONOTONIC). Median of --iters runs
per case after one warm-up run. Writes `"exposed_ms": [{"prompt_tokens", "streaming", "ms"}]`
into --out, merged with what the file already holds (the transfer benchmark's "sizes").

    python benchmarks/kv_streaming.py                      # H200: llama-3.2-1b shape, 1k and 8k
    python benchmarks/kv_streaming.py --preset tiny --device cpu --prompt-tokens 64,200 --iters 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-tokens", default="1024,8192")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--poll-while-busy",
        choices=("auto", "on", "off"),
        default="auto",
        help="kv_transfer.poll_while_busy on both sides (auto: the workers' default, on for CUDA)",
    )
    p.add_argument("--out", default=None, help="default: benchmarks/results/<gpu>-<date>/...")
    return p.parse_args(argv)


def _configs(args, model_dir: str):
    from splitserve.config.engine_config import EngineConfig
    from splitserve.prefill_worker.config import PrefillWorkerConfig

    longest = max(int(n) for n in args.prompt_tokens.split(","))
    blocks = 2 * -(-longest // args.block_size) + 2
    engine = EngineConfig(
        model_path=model_dir,
        device=args.device,
        cache={"block_size": args.block_size, "num_blocks": blocks},
        scheduler={
            "max_model_len": longest + 16,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
    )
    poll = {"auto": None, "on": True, "off": False}[args.poll_while_busy]
    return PrefillWorkerConfig(
        engine=engine,
        enable_prefix_cache=False,
        warmup=False,
        kv_transfer={"poll_while_busy": poll},
    )


def prefill_side(args, model_dir, info_q, cmd_q, out_q) -> None:
    import time

    from splitserve.engine.model_runner import ModelRunner
    from splitserve.kvtransfer.descriptor import PoolSpec, make_handle
    from splitserve.kvtransfer.server import KvTransferServer
    from splitserve.prefill_worker.engine import PrefillEngine
    from splitserve.prefill_worker.kv_source import EngineLeaseSource
    from splitserve.prefill_worker.kv_stream import attach_stream_hub
    from splitserve.request.sampling_params import SamplingParams

    cfg = _configs(args, model_dir)
    runner = ModelRunner(cfg.engine)

    async def main() -> None:
        engine = PrefillEngine(cfg, runner)
        await engine.start()
        heads = runner.model_config.num_key_value_heads
        spec = PoolSpec.of(runner.kv_cache, runner.compat_hash, heads)
        server = KvTransferServer(runner.kv_cache, spec, EngineLeaseSource(engine), cfg.kv_transfer)
        hub = attach_stream_hub(engine, server, cfg.kv_transfer, spec)
        compute_end: dict[str, float] = {}
        after_step = hub.after_step

        def marked_after_step() -> None:  # the step thread returned: this step's compute ended
            now = time.perf_counter()
            for seq, *_ in hub._step:  # noqa: SLF001 - the benchmark reads the step in flight
                compute_end[seq.request_id] = now
            after_step()

        hub.after_step = marked_after_step
        port = await server.start()
        info_q.put(
            (port, runner.compat_hash, heads, str(runner.dtype), runner.model_config.vocab_size)
        )
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        while (cmd := await asyncio.to_thread(cmd_q.get)) is not None:
            rid, prompt = cmd
            res = await engine.prefill(rid, prompt, params, 30.0, stream_token=_token(rid))
            handle = make_handle(
                spec,
                host="127.0.0.1",
                port=port,
                lease_id=res.lease.lease_id,
                request_id=rid,
                num_blocks=len(res.lease.block_ids),
                num_tokens=len(prompt),
                ttl_s=30.0,
            )
            out_q.put((rid, compute_end.pop(rid), handle.SerializeToString()))
        await server.close()
        await engine.stop()

    asyncio.run(main())


def _token(rid: str) -> str:
    """The stream secret both sides know here (the router makes a random one per request)."""
    return f"bench-stream-{rid}"


def decode_side(args, info, cmd_q, out_q) -> None:
    import time

    import torch

    from splitserve.kvtransfer.client import KvTransferClient
    from splitserve.kvtransfer.descriptor import PoolSpec
    from splitserve.kvtransfer.layer_stream_client import LayerStreamClient
    from splitserve.kvtransfer.metrics import KvTransferMetrics
    from splitserve.kvtransfer.progress_wait import set_up_progress
    from splitserve.protos import kv_pb2

    port, compat, heads, dtype, layers, head_dim, blocks = info
    device = torch.device(args.device)
    pool = torch.zeros(
        layers, 2, blocks, args.block_size, heads, head_dim,
        dtype=getattr(torch, dtype.removeprefix("torch.")), device=device,
    )  # fmt: skip
    spec = PoolSpec.of(pool, compat, heads)
    cfg = _configs(args, "").kv_transfer  # the prefill side's settings
    client = KvTransferClient(pool, spec, cfg)
    streamer = LayerStreamClient(pool, spec, cfg, client.pool, KvTransferMetrics())

    async def main() -> None:
        import ucxx

        ucxx.get_active_transports()  # the context and its progress thread, as a worker's start
        set_up_progress(cfg, device.type)
        while (cmd := await asyncio.to_thread(cmd_q.get)) is not None:
            rid, n, handle = cmd
            dest = list(range(1, -(-n // args.block_size) + 1))
            if handle is None:
                got = await streamer.pull("127.0.0.1", port, rid, n, dest, _token(rid))
                out_q.put((rid, got.last_piece_at))
            else:
                await client.pull(kv_pb2.KvHandle.FromString(handle), dest)
                out_q.put((rid, time.perf_counter()))
        client.close()

    asyncio.run(main())


def _model_dir(args) -> str:
    from splitserve.cli.make_model import make_model

    root = Path(os.environ.get("SPLITSERVE_CACHE", Path(tempfile.gettempdir()) / "splitserve"))
    model_dir = Path(args.model_dir or root / "models" / args.preset)
    if not (model_dir / "config.json").is_file():
        print(f"writing the {args.preset} checkpoint to {model_dir} ...", file=sys.stderr)
        make_model(args.preset, model_dir)
    return str(model_dir)


def default_out(device: str) -> Path:
    import torch

    gpu = "cpu"
    if device.startswith("cuda"):
        gpu = torch.cuda.get_device_name(torch.device(device)).split()[-1].lower()
    day = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    return Path(__file__).parent / "results" / f"{gpu}-{day}" / "kv_handover.json"


class SideDied(RuntimeError):
    pass


def get_alive(q, procs, timeout: float):
    """q.get that gives up as soon as one of `procs` (the two sides) has exited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p is not None and not p.is_alive()]
            if dead:
                raise SideDied(
                    f"{dead[0].name} exited (code {dead[0].exitcode}); see above"
                ) from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer within {timeout:g}s") from None


def run_case(qs, n: int, streaming: bool, rid: str, vocab: int, procs=()) -> float:
    p_cmd, p_out, d_cmd, d_out = qs
    prompt = [1] + [(hash((rid, i)) % (vocab - 3)) + 3 for i in range(n - 1)]
    if streaming:
        d_cmd.put((rid, n, None))  # the decode side attaches first, like the router's Decode
    p_cmd.put((rid, prompt))
    _, end, handle = get_alive(p_out, procs, 300)
    if not streaming:
        d_cmd.put((rid, n, handle))  # the router's hop
    _, landed = get_alive(d_out, procs, 300)
    return (landed - end) * 1000


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = _model_dir(args)
    ctx = mp.get_context("spawn")
    info_q, p_cmd, p_out, d_cmd, d_out = (ctx.Queue() for _ in range(5))
    prefill = ctx.Process(
        target=prefill_side, args=(args, model_dir, info_q, p_cmd, p_out), name="prefill side"
    )
    prefill.start()
    try:
        port, compat, heads, dtype, vocab = get_alive(info_q, [prefill], 600)
    except (SideDied, TimeoutError) as exc:
        prefill.kill()
        print(f"kv_streaming: the prefill side did not start: {exc}", file=sys.stderr)
        return 1
    cfg = json.loads(Path(model_dir, "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    blocks = _configs(args, model_dir).engine.cache.num_blocks
    info = (port, compat, heads, dtype, cfg["num_hidden_layers"], head_dim, blocks)
    decode = ctx.Process(target=decode_side, args=(args, info, d_cmd, d_out), name="decode side")
    decode.start()
    rows, procs = [], (prefill, decode)
    try:
        qs = (p_cmd, p_out, d_cmd, d_out)
        for n in (int(x) for x in args.prompt_tokens.split(",")):
            for streaming in (True, False):
                tag = f"{n}-{'s' if streaming else 'p'}"
                run_case(qs, n, streaming, f"{tag}-warm", vocab, procs)
                ms = [
                    run_case(qs, n, streaming, f"{tag}-{i}", vocab, procs)
                    for i in range(args.iters)
                ]
                rows.append(
                    {"prompt_tokens": n, "streaming": streaming, "ms": statistics.median(ms)}
                )
                print(f"{n:6d} tokens streaming={streaming!s:5}: exposed {rows[-1]['ms']:.3f} ms"
                      f" (runs {', '.join(f'{x:.3f}' for x in ms)})", file=sys.stderr)  # fmt: skip
    except (SideDied, TimeoutError) as exc:
        print(f"kv_streaming: {exc}", file=sys.stderr)
        return 1
    finally:
        p_cmd.put(None)
        d_cmd.put(None)
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    out = Path(args.out) if args.out else default_out(args.device)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(out.read_text()) if out.is_file() else {}
    data["exposed_ms"] = rows
    data["exposed_setup"] = {
        "benchmark": "kv_streaming.py",
        "preset": args.preset,
        "device": args.device,
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "iters": args.iters,
        "statistic": "median",
    }
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
