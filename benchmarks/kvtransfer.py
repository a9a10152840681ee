"""KV transfer benchmark (two processes on one GPU host; cuda_ipc where UCX picks it).

For payloads from 1 MiB to 1 GiB and the KV of a 1k / 8k-token prompt of the llama-3.2-1b
shape, prints side by side, measured in the same run:
  splitserve path  pack + send + checksum + unpack through KvTransferServer/Client
  raw ucxx         one contiguous buffer sent over a ucxx endpoint
  d2d copy         a device-to-device copy of the same bytes (the local ceiling)
and writes JSON (--out). Runs on CPU too (TCP loopback), where only ratios mean anything.

    python benchmarks/kvtransfer.py --out kv.json
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes-mib", default="1,4,16,64,256,1024", help="payload sizes in MiB")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


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


def _server(port_q, cmd_q, sizes, device):
    import torch

    from splitserve.kvtransfer.config import KvTransferConfig
    from splitserve.kvtransfer.descriptor import PoolSpec
    from splitserve.kvtransfer.server import KvTransferServer

    class Leases:
        def __init__(self, n):
            self.n = n

        def begin_pull(self, lease_id, request_id):
            return list(range(1, self.n + 1))

        def end_pull(self, lease_id, delivered):
            pass

    async def main():
        import ucxx

        servers, raws = [], []
        for nbytes in sizes:
            pool, n = _pool_for(nbytes, device)
            srv = KvTransferServer(pool, PoolSpec.of(pool, "bench"), Leases(n), KvTransferConfig())
            await srv.start()
            buf = torch.empty(
                n * (pool[0, 0, 0].numel() * 2 * pool.shape[0]) * 2,
                dtype=torch.uint8,
                device=device,
            )

            async def raw_handler(ep, buf=buf):
                from splitserve.kvtransfer.buffers import ucx_view

                while True:
                    try:
                        await ep.recv_obj()
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
    import torch
    from tqdm import tqdm

    from splitserve.kvtransfer.buffers import ucx_view
    from splitserve.kvtransfer.client import KvTransferClient
    from splitserve.kvtransfer.config import KvTransferConfig
    from splitserve.kvtransfer.descriptor import PoolSpec, make_handle

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    g = LLAMA_1B
    per_token = 2 * g["layers"] * g["heads"] * g["head_dim"] * g["elem"]
    cases = [(f"{m} MiB", m * MIB) for m in map(int, args.sizes_mib.split(","))]
    cases += [("1k-token prompt", 1024 * per_token), ("8k-token prompt", 8192 * per_token)]
    ctx = mp.get_context("spawn")
    port_q, cmd_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(
        target=_server, args=(port_q, cmd_q, [c[1] for c in cases], str(device)), daemon=True
    )
    proc.start()
    ports = [port_q.get(timeout=300) for _ in cases]
    rows = []

    async def measure():
        import ucxx

        for (name, _), (kv_port, raw_port, n) in tqdm(
            list(zip(cases, ports)), desc="kv transfer", unit="size"
        ):
            pool, _ = _pool_for(n * per_token * 16, device)
            client = KvTransferClient(pool, PoolSpec.of(pool, "bench"), KvTransferConfig())
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
            raw_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            src = torch.empty_like(raw_buf)
            t_path, t_raw, t_copy = [], [], []
            for i in range(args.iters + 1):
                t0 = time.perf_counter()
                await client.pull(handle, list(range(1, n + 1)))
                t1 = time.perf_counter()
                await ep.send_obj(b"go")
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
            )
            rows.append(row)
            tqdm.write(
                f"{name:>16}  path {row['path_ms']:8.3f} ms {row['path_GBps']:7.1f} GB/s | raw ucxx "
                f"{row['raw_ms']:8.3f} ms {row['raw_GBps']:7.1f} GB/s | d2d copy {row['copy_ms']:7.3f} ms"
                f" | path/raw bandwidth {row['path_vs_raw']:.2f}"
            )
            await ep.close()
            client.close()

    asyncio.run(measure())
    cmd_q.put("stop")
    proc.join(timeout=10)
    import ucxx

    result = dict(device=str(device), transports=sorted(ucxx.get_active_transports()), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
