"""Streamed hand-overs from a tensor-parallel prefill worker: every rank streams its own KV heads.

    rank 0 (MirroredStreamHub: its engine)           follower rank r (FollowerStreamHub)
    ──────────────────────────────────────           ───────────────────────────────────
    added (a request with a stream token) ─("stream_add")─▶ a stand-in sequence
    before_step: this step's chunks        ─("stream_step")▶ before_step (same chunks, tables)
    runner.prefill ─────────────────────────("prefill")────▶ same forward; its layer hook feeds
                                                             the rank's own hub; after_step
    finished (lease granted first)         ─("stream_end")─▶ final marker: OK, no first token,
                                                             no lease (only rank 0's has them)
    aborted / lease dropped                ─("stream_end")─▶ queued pieces dropped, ABORTED

The commands travel in rank 0's ordered control stream (tp_messages.py), so a follower sees a
step's chunks before that step's forward and a lease drop before any forward that could reuse
its blocks. Follower handlers run on the command thread; they hand over to the hub's event loop
(call_soon_threadsafe keeps their order, and the layer hook's). The decode side streams every
rank (kvtransfer/layer_stream_shards.py); only rank 0's KvPullDone releases the lease, and it is
sent once every shard landed, so a follower's blocks stay valid while it streams (as for a pull).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

from splitserve.prefill_worker.kv_stream import StreamEnd, StreamHub, hook_layers, serve_hub
from splitserve.protos import kv_pb2

log = logging.getLogger("splitserve.prefill_worker.tp")
_FINISHED, _ENDED = 0, 1  # stream_end kinds: the prompt is done; aborted or its lease dropped


class MirroredStreamHub(StreamHub):
    """Rank 0's hub: also publishes what the followers' hubs need (`publish`: runner.mirror)."""

    def __init__(self, engine, num_layers: int, groups: int, wait_s: float, publish) -> None:
        super().__init__(engine, num_layers, groups, wait_s)
        self._publish = publish
        self._mirrored: set[str] = set()  # requests the followers know, until their end

    def _tell(self, cmd: tuple) -> None:
        try:
            self._publish(cmd)
        except RuntimeError:  # the followers are gone: the worker stops serving (tp_lifecycle)
            log.debug("stream command %s not mirrored: the followers are gone", cmd[0])

    def added(self, request_id: str) -> None:
        seq = self.engine.scheduler.find(request_id)
        if seq is not None and seq.stream_token:  # only a request with a token can be streamed
            self._mirrored.add(request_id)
            self._tell(("stream_add", request_id, seq.stream_token, len(seq.prompt)))
        super().added(request_id)

    def before_step(self, batch) -> None:
        chunks = [
            (c.seq.request_id, c.start, c.end, tuple(c.seq.block_table))
            for c in batch
            if c.seq.request_id in self._mirrored
        ]
        if chunks:  # before the step's "prefill" command: the followers pair them
            self._tell(("stream_step", chunks))
        super().before_step(batch)

    def finished(self, seq, result) -> None:
        rid = seq.request_id
        if rid in self._mirrored:
            lease = result.lease
            if lease is None:
                self._mirrored.discard(rid)
            self._tell(
                (
                    "stream_end",
                    rid,
                    _FINISHED,
                    lease.lease_id if lease else "",
                    lease.num_tokens if lease else 0,
                    int(lease is None),
                    "",
                )
            )
        super().finished(seq, result)

    def aborted(self, request_id: str, why: str) -> None:
        self._end(request_id, why)
        super().aborted(request_id, why)

    def lease_gone(self, request_id: str, why: str = "the lease was dropped") -> None:
        self._end(request_id, why)
        super().lease_gone(request_id, why)

    def _end(self, request_id: str, why: str) -> None:
        if request_id in self._mirrored:
            self._mirrored.discard(request_id)
            self._tell(("stream_end", request_id, _ENDED, "", 0, 0, why))


@dataclass(eq=False)
class _Seq:
    """What StreamHub reads of a prefill sequence, on a follower."""

    request_id: str
    stream_token: str
    prompt: range
    block_table: tuple[int, ...] = ()
    num_computed: int = 0
    first_kv_at: float = 0.0


@dataclass(eq=False)
class _Chunk:
    seq: _Seq
    start: int
    end: int


class _NoMetric:
    def observe(self, _value: float) -> None:
        pass


@dataclass(eq=False)
class _FollowerEngine:
    """What StreamHub reads of an engine, on a follower: rank 0's requests as mirrored, the
    leases as MirrorLeaseSource holds them; releasing a lease is rank 0's."""

    runner: object
    mirror_leases: object  # tp_follower.MirrorLeaseSource
    seqs: dict[str, _Seq] = field(default_factory=dict)
    lease_tokens: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.scheduler = SimpleNamespace(find=self.seqs.get)
        self.leases = SimpleNamespace(get=self._lease)
        self.metrics = SimpleNamespace(stream_attach_wait_seconds=_NoMetric())

    def _lease(self, lease_id: str):
        blocks = self.mirror_leases.blocks(lease_id)
        if blocks is None:
            self.lease_tokens.pop(lease_id, None)
            return None
        return SimpleNamespace(block_ids=blocks, num_tokens=self.lease_tokens.get(lease_id, 0))

    def release_lease(self, lease_id: str) -> None:
        pass


class FollowerStreamHub(StreamHub):
    """A follower rank's hub (its event loop), fed by rank 0's stream commands."""

    def __init__(self, runner, mirror_leases, cfg) -> None:
        engine = _FollowerEngine(runner, mirror_leases)
        kv = cfg.kv_transfer
        super().__init__(
            engine,
            runner.model_config.num_hidden_layers,
            kv.stream_layer_groups,
            kv.lease_request_timeout_s,
        )
        self._hooked = False

    def hook(self) -> None:
        """Command thread, at the first stream_add (after rank 0's warm-up, so the layer hook
        never fires inside it), before any forward of that request."""
        if not self._hooked:
            self._hooked = True
            hook_layers(self, self.engine.runner)

    def on_add(self, request_id: str, token: str, prompt_len: int) -> None:
        self.engine.seqs[request_id] = _Seq(request_id, token, range(prompt_len))
        self.added(request_id)

    def on_step(self, chunks) -> None:
        batch = []
        for rid, start, end, table in chunks:
            if (seq := self.engine.seqs.get(rid)) is not None:
                # as on rank 0: what precedes the chunk (prefix-cache hits, earlier chunks) is
                # computed, so an attach during this step catches up to `start` first
                seq.block_table, seq.num_computed = table, max(seq.num_computed, start)
                batch.append(_Chunk(seq, start, end))
        self.before_step(batch)

    def on_prefill_done(self) -> None:
        for seq, _, end, _ in self._step:
            seq.num_computed = max(seq.num_computed, end)
        self.after_step()

    def on_end(
        self, rid: str, kind: int, lease_id: str, num_tokens: int, finished: int, why: str
    ) -> None:
        seq = self.engine.seqs.pop(rid, None)
        if kind != _FINISHED:
            self.lease_gone(rid, why)  # queued pieces may name blocks rank 0 frees next
            return
        # the follower's own final marker: the first token and the lease are rank 0's
        end = StreamEnd(kv_pb2.KV_PULL_STATUS_OK, finished=bool(finished))
        if lease_id and seq is not None:
            self.engine.lease_tokens[lease_id] = num_tokens
            self._remember(rid, end, seq.stream_token, lease_id)
        if (feed := self.feeds.get(rid)) is not None:
            feed.end(end)


def follower_stream_handlers(runner, leases, server, spec, cfg, rank: int) -> dict:
    """The stream commands' handlers of follower `rank` (its command thread), and "prefill"
    wrapped so that its hub learns when the step's forward is done. Call on its event loop."""
    loop = asyncio.get_running_loop()
    hub = FollowerStreamHub(runner, leases, cfg)
    faults = cfg.faults.transfer.for_stream_rank(rank)
    serve_hub(hub, runner, server, cfg.kv_transfer.for_rank(rank), spec, faults)

    def on_loop(fn):
        return lambda *args: loop.call_soon_threadsafe(fn, *args)

    def stream_add(*args) -> None:
        hub.hook()
        loop.call_soon_threadsafe(hub.on_add, *args)

    return {
        "stream_add": stream_add,
        "stream_step": on_loop(hub.on_step),
        "stream_end": on_loop(hub.on_end),
        "prefill_done": on_loop(hub.on_prefill_done),
    }
