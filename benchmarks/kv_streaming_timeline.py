"""Where a streamed hand-over's exposed time goes: `kv_streaming.py` with each piece timed on
both sides (one monotonic clock, two processes), printed per run relative to the prefill's
`finished` (the first token is known; what follows is exposed).

    P group g   the prefill hub heard that layer group g's KV write was issued (a CUDA event)
    P piece     the sender took a piece from the feed; P ready: its gather (after the group's
                event) finished; P sent: header sent, payload posted
    D head      the decode side received the piece's header; D landed: it is in its blocks
    P finished  the prompt is done (the final message follows); B end: the decode side has all

A piece whose `P ready` comes long after its `P group` waited for the GPU (the prefill
compute); a `D head` long after the previous `D landed`, for the sender; gaps between `P sent`
and `D landed` are the wire and the landing. Same arguments as kv_streaming.py, plus
--timeline FILE (JSON lines, default: next to --out).

    python benchmarks/kv_streaming_timeline.py --model-dir /tmp/l1b --prompt-tokens 8192 --iters 2
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_streaming  # noqa: E402

_ENV = "SPLITSERVE_KV_TIMELINE"


def _log(role: str, label: str, **kw) -> None:
    with open(os.environ[_ENV], "a") as f:
        f.write(json.dumps({"role": role, "label": label, "t": time.perf_counter(), **kw}) + "\n")


def timed_prefill_side(*args) -> None:
    from splitserve.kvtransfer import layer_stream_server as server
    from splitserve.prefill_worker import kv_stream

    send_piece = server.LayerStreamSender._send_piece
    group_ready, finished = kv_stream.StreamHub._group_ready, kv_stream.StreamHub.finished

    async def piece(self, ep, p, timeout, *rest):
        _log("P", "piece", layers=[p.layer_start, p.layer_end], blocks=[p.block_start, p.block_end])
        wait = self.stream.wait

        async def gathered():
            await wait()
            _log("P", "ready")

        self.stream.wait = gathered
        try:
            posted = await send_piece(self, ep, p, timeout, *rest)
        finally:
            self.stream.wait = wait
        _log("P", "sent")
        return posted

    def ready(self, lo, hi, event):
        _log("P", "group", g=lo)
        return group_ready(self, lo, hi, event)

    def done(self, seq, result):
        _log("P", "finished")
        return finished(self, seq, result)

    server.LayerStreamSender._send_piece = piece
    kv_stream.StreamHub._group_ready, kv_stream.StreamHub.finished = ready, done
    kv_streaming.prefill_side(*args)


def timed_decode_side(*args) -> None:
    from splitserve.kvtransfer import layer_stream_client as client

    land = client.LayerStreamClient._land

    async def timed_land(self, ep, head, landing, verify):
        _log("D", "head", layers=[head.layer_start, head.layer_end])
        n = await land(self, ep, head, landing, verify)
        _log("D", "landed")
        return n

    client.LayerStreamClient._land = timed_land
    kv_streaming.decode_side(*args)


def summary(path: Path) -> list[str]:
    """One line per streamed run: its events in ms from `P finished`."""
    runs: dict[str, list[dict]] = {}
    current = None
    for line in path.read_text().splitlines():
        e = json.loads(line)
        if e["label"] == "case":
            current = e["rid"] if e["streaming"] else None
            if current:
                runs[current] = []
        elif current is not None:
            runs[current].append(e)
    lines = []
    for rid, events in runs.items():
        fin = next((e["t"] for e in events if e["label"] == "finished"), events[0]["t"])
        parts = [
            f"{e['role']} {e['label']}{e.get('g', '')} {(e['t'] - fin) * 1e3:+.2f}" for e in events
        ]
        lines.append(f"{rid}: " + ", ".join(parts))
    return lines


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    timeline = None
    if "--timeline" in argv:
        i = argv.index("--timeline")
        timeline = Path(argv[i + 1])
        del argv[i : i + 2]
    args = kv_streaming.parse_args(argv)
    out = Path(args.out) if args.out else kv_streaming.default_out(args.device)
    timeline = timeline or out.with_name(out.stem + "_timeline.jsonl")
    timeline.parent.mkdir(parents=True, exist_ok=True)
    timeline.write_text("")
    os.environ[_ENV] = str(timeline.resolve())  # the spawned sides inherit it
    run_case = kv_streaming.run_case

    def timed_case(qs, n, streaming, rid, vocab, procs=()):
        _log("B", "case", rid=rid, streaming=streaming)
        ms = run_case(qs, n, streaming, rid, vocab, procs)
        _log("B", "end", rid=rid)
        return ms

    kv_streaming.prefill_side, kv_streaming.decode_side = timed_prefill_side, timed_decode_side
    kv_streaming.run_case = timed_case
    rc = kv_streaming.main(argv)
    for line in summary(timeline):
        print(line)
    return rc


if __name__ == "__main__":
    sys.exit(main())
