"""KV transfer benchmark (two processes on one GPU host; cuda_ipc where UCX picks it).

For payloads from 1 MiB to 1 GiB and the KV of a 1k / 8k-token prompt of the llama-3.2-1b
shape, prints side by side, measured in the same run:
  splitserve path  a whole pull through KvTransferServer/Client (request, reply, payload;
                   zero-copy slabs for a contiguous run of blocks, else pack + unpack;
                   the checksum per `--checksum`, default between_hosts: off on one host)
  raw ucxx         one contiguous buffer sent over a ucxx endpoint after a one-message request
  d2d copy         a device-to-device copy of the same bytes (the local ceiling)
`--scattered` gives each side a non-contiguous block list (the pack/unpack path). Runs on CPU
too (TCP loopback or shared memory), where only ratios mean anything.

`--out` merges into that JSON file (other keys, e.g. the streaming case's "exposed_ms", are
kept): "sizes": [{"mib", "path_ms", "raw_ms", "ratio" (raw_ms / path_ms)}], the issue-32
table, and "kvtransfer_rows" with every case's details.

    python benchmarks/kvtransfer.py --out benchmarks/results/<gpu>-<date>/kv_handover.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time

MIB = 2**20
# llama-3.2-1b: 16 layers, 8 kv heads, head_dim 64, bf16 -> 32 KiB of K+V per token
LLAMA_1B = dict(layers=16, heads=8, head_dim=64, elem=2)
CHECKSUM_MODES = ("between_hosts", "always", "never")


def block_list(n: int, scattered: bool) -> list[int]:
    """Blocks 1..n: in order (one contiguous run), or every other block first (no run)."""
    ids = list(range(1, n + 1))
    return ids[::2] + ids[1::2] if scattered else ids


def merge_json(path: str, update: dict) -> dict:
    """`update` written over the keys of the JSON object at `path` (created if missing)."""
    import os

    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data.update(update)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return data


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes-mib", default="1,16,64,256,1024", help="payload sizes in MiB")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-prompts", action="store_true", help="skip the 1k / 8k-token cases")
    p.add_argument("--scattered", action="store_true", help="non-contiguous blocks (pack path)")
    p.add_argument("--checksum", default="between_hosts", choices=CHECKSUM_MODES)
    p.add_argument(
        "--progress-wait-ms",
        type=int,
        default=None,
        help="ucxx progress thread's wait on both sides (kv_transfer.progress_wait_ms; "
        "default: the workers' default for the device)",
    )
    p.add_argument(
        "--poll-while-busy",
        choices=("auto", "on", "off"),
        default="auto",
        help="kv_transfer.poll_while_busy on both sides (auto: the workers' default, on for CUDA)",
    )
    p.add_argument("--out", default=None, help="JSON file to write or merge into")
    return p.parse_args(argv)


def _transfer_config(args):
    from splitserve.kvtransfer.config import KvTransferConfig

    poll = {"auto": None, "on": True, "off": False}[args.poll_while_busy]
    return KvTransferConfig(
        checksum=args.checksum, progress_wait_ms=args.progress_wait_ms, poll_while_busy=poll
    )


def _pool_for(nbytes: int, device):
    """A bf16 pool of the llama-1b geometry whose `n` blocks (block_size 16) hold ~nbytes."""
    import torch

    g = LLAMA_1B
    block_bytes = 2 * g["layers"] * 16 * g["heads"] * g["head_dim"] * g["elem"]
    n = max(1, nbytes // block_bytes)
    pool = torch.randn(g["layers"], 2, n + 1, 16, g["heads"], g["head_dim"], device=device).to(
        torch.bfloat16
    )
    return pool, n


def _server(port_q, cmd_q, sizes, device, scattered, args):
    import torch

    from splitserve.kvtransfer.descriptor import PoolSpec
    from splitserve.kvtransfer.server import KvTransferServer

    class Leases:
        def __init__(self, n):
            self.n = n

        def begin_pull(self, lease_id, request_id):
            return block_list(self.n, scattered)

        def end_pull(self, lease_id, delivered):
            pass

    async def main():
        import ucxx

        servers, raws = [], []
        for nbytes in sizes:
            pool, n = _pool_for(nbytes, device)
            cfg = _transfer_config(args)
            srv = KvTransferServer(pool, PoolSpec.of(pool, "bench"), Leases(n), cfg)
            await srv.start()
            buf = torch.empty(
                n * (pool[0, 0, 0].numel() * 2 * pool.shape[0]) * 2,
                dtype=torch.uint8,
                device=device,
            )

            async def raw_handler(ep, buf=buf):
                import numpy as np

                from splitserve.kvtransfer.buffers import ucx_view
                from splitserve.kvtransfer.idle_wait import PullWake, until_message

                wake, req = PullWake(), np.empty(64, np.uint8)
                while True:
                    try:  # waits for a request as the KV listener does (no polling receive)
                        await until_message(ep, time.monotonic(), lambda: True, wake)
                        await ep.recv(req)
                    except Exception:
                        return
                    await ep.send(ucx_view(buf))

            lst = ucxx.create_listener(raw_handler, 0)
            servers.append(srv)
            raws.append(lst)
            port_q.put((srv.port, lst.port, n))
        await asyncio.to_thread(cmd_q.get)

    asyncio.run(main())


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch
    from tqdm import tqdm

    from splitserve.kvtransfer.buffers import ucx_view
    from splitserve.kvtransfer.client import KvTransferClient
    from splitserve.kvtransfer.descriptor import PoolSpec, make_handle
    from splitserve.kvtransfer.pull_stats import PHASES

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    g = LLAMA_1B
    per_token = 2 * g["layers"] * g["heads"] * g["head_dim"] * g["elem"]
    cases = [(f"{m} MiB", m * MIB) for m in map(int, args.sizes_mib.split(","))]
    if not args.no_prompts:
        cases += [("1k-token prompt", 1024 * per_token), ("8k-token prompt", 8192 * per_token)]
    ctx = mp.get_context("spawn")
    port_q, cmd_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(
        target=_server,
        args=(
            port_q,
            cmd_q,
            [c[1] for c in cases],
            str(device),
            args.scattered,
            args,
        ),
        daemon=True,
    )
    proc.start()
    ports = [port_q.get(timeout=300) for _ in cases]
    rows = []

    async def measure():
        import ucxx

        from splitserve.kvtransfer.progress_wait import set_up_progress

        ucxx.get_active_transports()  # the context and its progress thread, then their wait
        set_up_progress(_transfer_config(args), device.type)
        for (name, _), (kv_port, raw_port, n) in tqdm(
            list(zip(cases, ports)), desc="kv transfer", unit="size"
        ):
            pool, _ = _pool_for(n * per_token * 16, device)
            cfg = _transfer_config(args)
            client = KvTransferClient(pool, PoolSpec.of(pool, "bench"), cfg)
            spec = PoolSpec.of(pool, "bench")
            handle = make_handle(
                spec,
                host="127.0.0.1",
                port=kv_port,
                lease_id="L",
                request_id="r",
                num_blocks=n,
                num_tokens=n * 16,
                ttl_s=60,
            )
            nbytes = n * spec.block_bytes()
            ep = await ucxx.create_endpoint("127.0.0.1", raw_port)
            go = np.frombuffer(b"go", np.uint8).copy()
            dest = block_list(n, args.scattered)
            raw_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            src = torch.empty_like(raw_buf)
            t_path, t_raw, t_copy, phases = [], [], [], []
            for i in range(args.iters + 1):
                t0 = time.perf_counter()
                stats = await client.pull(handle, dest)
                t1 = time.perf_counter()
                await ep.send(go)
                await ep.recv(ucx_view(raw_buf))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t2 = time.perf_counter()
                raw_buf.copy_(src)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t3 = time.perf_counter()
                if i:  # first round warms endpoints, kernels and allocators
                    t_path.append(t1 - t0), t_raw.append(t2 - t1), t_copy.append(t3 - t2)
                    phases.append(stats.phases)
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            row = dict(
                case=name,
                bytes=nbytes,
                path_ms=med(t_path) * 1e3,
                raw_ms=med(t_raw) * 1e3,
                copy_ms=med(t_copy) * 1e3,
            )
            row |= dict(
                path_GBps=nbytes / med(t_path) / 1e9,
                raw_GBps=nbytes / med(t_raw) / 1e9,
                copy_GBps=2 * nbytes / med(t_copy) / 1e9,
                path_vs_raw=med(t_raw) / med(t_path),
                # where the path's time goes (medians of each phase, kvtransfer/pull_stats.py)
                path_phases_ms={k: round(med([p[k] for p in phases]) * 1e3, 4) for k in PHASES},
            )
            rows.append(row)
            tqdm.write(
                f"{name:>16}  path {row['path_ms']:8.3f} ms {row['path_GBps']:7.1f} GB/s | raw ucxx "
                f"{row['raw_ms']:8.3f} ms {row['raw_GBps']:7.1f} GB/s | d2d copy {row['copy_ms']:7.3f} ms"
                f" | path/raw bandwidth {row['path_vs_raw']:.2f}\n{'':>16}  path phases ms: "
                + ", ".join(f"{k} {v:.3f}" for k, v in row["path_phases_ms"].items())
            )
            await ep.close()
            client.close()

    asyncio.run(measure())
    cmd_q.put("stop")
    proc.join(timeout=10)
    import ucxx

    sizes = [
        dict(
            mib=r["bytes"] // MIB,
            path_ms=round(r["path_ms"], 4),
            raw_ms=round(r["raw_ms"], 4),
            ratio=round(r["raw_ms"] / r["path_ms"], 4),
        )
        for r in rows
        if r["case"].endswith(" MiB")
    ]
    result = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        transports=sorted(ucxx.get_active_transports()),
        progress_wait_ms=args.progress_wait_ms,
        poll_while_busy=args.poll_while_busy,
        sizes=sizes,
        kvtransfer_rows=rows,
        kvtransfer_command="python benchmarks/kvtransfer.py " + " ".join(argv or sys.argv[1:]),
    )
    if args.out:
        merge_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
