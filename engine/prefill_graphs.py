"""Piecewise CUDA graphs for prefill (TensorRT-LLM's context-step graphs): the non-attention
parts of every layer captured at fixed token counts, varlen attention run eagerly between them.

A step of T tokens runs at the smallest bucket N >= T (`sizes`, default 16, 32, ..., 8192; the
token budget caps them). Its T tokens are padded to N with null-slot tokens (id 0, position 0,
slot 0 of the null block, as the decode graphs pad lanes: decode_worker/graph_runner.py), which
belong to no sequence: attention never computes their rows, their K/V land in the null block,
and every other op is row-wise, so the real rows are what the eager step computes. Pieces of
an N-token step, for L layers (model.py: DecoderLayer.pre_attention / post_attention):

    piece 0      embedding, layer 0's norm + QKV + RoPE + KV write       -> q, residual
    piece i      layer i-1's O projection + MLP, layer i's pre-attention  -> q, residual
    piece L      layer L-1's O projection + MLP                           -> hidden, residual
    between:     ops.prefill_attention(q[:T], ...) over cu_seqlens / context_lens / block
                 tables of the real sequences, into attn[:T] (eager: its grid and metadata
                 vary with the batch)

Every piece reads and writes static buffers sized to the largest bucket, so the graphs share
one memory pool (the decode graphs' pool in a decode worker) for their temporaries. The final
norm + lm_head run eagerly on the sampled rows.

A step of at most FUSED_SEQS sequences in a bucket up to FUSED_MAX_TOKENS runs "fused" pieces
instead (`run_fused`, from the host lists): the same pieces with each layer's attention
captured after its pre-attention part, reading static inputs and metadata (cu_seqlens /
context_lens / block tables of FUSED_SEQS rows, the unused ones without tokens) that two pinned
copies fill (prefill_graph_inputs.py).

A step of one fresh prompt (nothing cached before it: `meta.dense_causal`) in a bucket of at
least DENSE_MIN_TOKENS (engine/prefill_dense.py) runs its attention as one dense causal call
instead (kernels/dense_attention.py: cuDNN's fused attention, 1.3-1.8x the Triton kernel's speed
there), its T tokens padded to a multiple of `dense_step(N)` (a sixteenth of the bucket, at
least 256: attention's work grows with the square of the length, so not to the bucket) to keep
cuDNN to a few plans, each built before SERVING on the thread that runs steps
(`prepare_dense_here`; never while a user waits), after `capture` checked the call against the
varlen kernel; where cuDNN's attention is missing or disagrees, one log line and the varlen
kernel.

`on_layer_kv(i)`, when set, is called right after piece i has written layer i's KV (and, in
fused pieces, run its attention): a place for per-layer-group CUDA events, for a KV hand-over
that streams layers as they finish. Without CUDA, or before `capture`, `run` runs
the same pieces eagerly on the padded buffers (the CPU tests check that path against the plain
eager step). Steps above the largest bucket, tensor-parallel runners and --no-cuda-graph keep
the plain eager path (model_runner.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch

from splitserve.engine import prefill_dense
from splitserve.engine.attention_metadata import AttentionMetadata
from splitserve.engine.prefill_dense import build_dense_plans, check_dense, dense_len
from splitserve.engine.prefill_graph_inputs import NULL_SLOT, FusedInputs
from splitserve.engine.prefill_graph_sizes import graph_sizes
from splitserve.kernels.dense_attention import dense_causal_attention

log = logging.getLogger(__name__)

# A step of at most FUSED_SEQS sequences in a bucket up to FUSED_MAX_TOKENS replays "fused"
# pieces: each layer's attention captured in the piece that computes its q (static metadata; the
# kernel's programs of sequences without tokens return at once). Launching 16 attention
# kernels from Python cost more than the GPU's work at 128 tokens; one graph of the whole step
# was worse still: its launch took 0.48 ms of the host before the GPU started (H200, ~2 us per
# node), where pieces start the GPU after the first and launch the rest while it works.
FUSED_SEQS = 4
FUSED_MAX_TOKENS = 1024


class PrefillGraphs:
    def __init__(
        self,
        model,
        kv_cache: torch.Tensor,
        cos_sin: torch.Tensor,
        sizes: Sequence[int],
        max_blocks: int | None = None,
    ):
        """`max_blocks`: the widest block table a step can carry (default: the pool's size)."""
        if not sizes:
            raise ValueError("prefill graphs need at least one token count")
        self.model, self.kv_cache, self.cos_sin = model, kv_cache, cos_sin
        self.sizes = sorted(set(sizes))
        self.num_layers = len(model.layers)
        cfg, dev = model.cfg, kv_cache.device
        dtype = model.embed.dtype
        n, layer = self.sizes[-1], model.layers[0]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), NULL_SLOT, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.q = torch.zeros(n, layer.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.attn = torch.zeros(n, layer.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.fused_sizes = [s for s in self.sizes if s <= FUSED_MAX_TOKENS]
        self.fused = (
            FusedInputs(self.fused_sizes[-1], FUSED_SEQS, max_blocks or kv_cache.shape[2], dev)
            if self.fused_sizes
            else None
        )
        self._fused_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.num_fused = 0  # steps run as fused pieces (replayed or eager)
        self.pool = None
        self.on_layer_kv: Callable[[int], None] | None = None
        self.num_steps = 0  # steps run through the buckets (replayed or padded eager)
        self.num_replays = 0
        self.dense = False  # fresh single prompts' attention dense (checked by `capture`)
        self.dense_threads: set[int] = set()  # threads holding its cuDNN plans (per thread)
        self.num_dense = 0

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket(self, num_tokens: int) -> int:
        """The token count a step of `num_tokens` runs at; 0: above every bucket (eager)."""
        return next((n for n in self.sizes if n >= num_tokens), 0)

    # ---- one piece (captured, or run eagerly) -----------------------------------------------
    def _piece(self, n: int, i: int, inputs=None) -> None:
        """`inputs`: whose input_ids / positions / slot_mapping (self, or the fused inputs)."""
        m, src = self.model, inputs or self
        if i == 0:
            hidden, residual = m._embed(src.input_ids[:n]), None
        else:
            hidden, residual = m.layers[i - 1].post_attention(self.attn[:n], self.residual[:n])
        if i == self.num_layers:
            self.hidden[:n].copy_(hidden)
            self.residual[:n].copy_(residual)
            return
        kv = self.kv_cache[i]
        q, residual = m.layers[i].pre_attention(
            hidden, residual, src.positions[:n], self.cos_sin, kv[0], kv[1], src.slot_mapping[:n]
        )
        self.q[:n].copy_(q)
        self.residual[:n].copy_(residual)

    def _fused_piece(self, n: int, i: int) -> None:
        """Piece i on the fused inputs, then layer i's attention on their static metadata."""
        f = self.fused
        self._piece(n, i, f)
        if i < self.num_layers:
            meta = AttentionMetadata(
                slot_mapping=f.slot_mapping[:n],
                block_tables=f.tables,
                context_lens=f.lens,
                is_prefill=True,
                cu_seqlens_q=f.cu,
                max_query_len=n,
            )
            kv, layer = self.kv_cache[i], self.model.layers[i]
            layer.attention(self.q[:n], kv[0], kv[1], meta, out=self.attn[:n])

    # ---- capture ------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, pool=None, warmup_steps: int = 2) -> None:
        """Every bucket's pieces, largest first, into `pool` (a new one when None). CUDA only;
        writes only the null block (the caller zeroes the pool after)."""
        if self.kv_cache.device.type != "cuda":
            return
        dev = self.kv_cache.device
        self.slot_mapping.fill_(NULL_SLOT)
        self.positions.zero_()
        self.input_ids.zero_()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compile and pick every kernel before any capture
            for n in self.sizes:
                for _ in range(warmup_steps):
                    for i in range(self.num_layers + 1):
                        self._piece(n, i)
            for n in self.fused_sizes:  # (no sequence: the attention programs return at once)
                for i in range(self.num_layers + 1):
                    self._fused_piece(n, i)
            self.dense = check_dense(self)  # its plans: prepare_dense_here, where steps run
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        # largest first: smaller ones reuse its pool memory
        for table, sizes, body in (
            (self._graphs, self.sizes, self._piece),
            (self._fused_graphs, self.fused_sizes, self._fused_piece),
        ):
            for n in reversed(sizes):
                pieces = []
                for i in range(self.num_layers + 1):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        body(n, i)
                    pieces.append(graph)
                table[n] = pieces
        torch.cuda.synchronize(dev)
        log.info(
            "captured piecewise prefill graphs for %s tokens (%d pieces each)",
            self.sizes,
            self.num_layers + 1,
        )

    def release(self) -> None:
        """Drops every graph (idempotent); eager steps from here on."""
        if self._graphs and self.kv_cache.device.type == "cuda":
            torch.cuda.synchronize(self.kv_cache.device)  # no replay may still use the pool
        for table in (self._graphs, self._fused_graphs):
            for pieces in table.values():
                for g in pieces:
                    g.reset()
            table.clear()
        self.pool = None

    # ---- a step -------------------------------------------------------------------------------
    def _dense(self, n: int, fresh_single: bool) -> bool:
        # torch keeps cuDNN's attention plans per thread: elsewhere the varlen kernel serves,
        # rather than a plan built while a user waits
        return (
            self.dense
            and fresh_single
            and n >= prefill_dense.DENSE_MIN_TOKENS
            and threading.get_ident() in self.dense_threads
        )

    def prepare_dense_here(self) -> None:
        """Builds the dense attention's plans on the calling thread: the thread that runs the
        steps calls it before SERVING (the prefill worker's step thread at warm-up; a decode
        worker captures on a start-up thread and steps on its engine thread)."""
        if self.dense and threading.get_ident() not in self.dense_threads:
            self.dense = build_dense_plans(self)

    @torch.inference_mode()
    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """One prefill step of T = len(ids) <= the largest bucket tokens (device tensors; `meta`
        of the real sequences) -> fp32 logits of `rows`."""
        t = ids.shape[0]
        n = self.bucket(t)
        if n == 0:
            raise ValueError(f"{t} tokens exceed the largest prefill graph ({self.sizes[-1]})")
        self.input_ids[:t].copy_(ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(slots)
        self.input_ids[t:n].zero_()  # padding: token 0 at position 0 into the null slot
        self.positions[t:n].zero_()
        self.slot_mapping[t:n].fill_(NULL_SLOT)
        self.attn[t:n].zero_()  # attention never writes padding rows: keep them finite
        graphs = self._graphs.get(n)
        dense = dense_len(n, t) if self._dense(n, meta.dense_causal) else 0
        for i in range(self.num_layers + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(n, i)
            if i == self.num_layers:
                break
            if self.on_layer_kv is not None:
                self.on_layer_kv(i)
            kv, layer = self.kv_cache[i], self.model.layers[i]
            if dense:  # padding rows (null slot) come after every real one: causal, unseen
                sl = self.slot_mapping[:dense]
                dense_causal_attention(
                    self.q[:dense], kv[0], kv[1], sl, layer.scale, self.attn[:dense]
                )
            else:
                layer.attention(self.q[:t], kv[0], kv[1], meta, out=self.attn[:t])
        self.num_steps += 1
        self.num_dense += dense > 0
        self.num_replays += graphs is not None
        return self.model.final_logits(self.hidden[:t], self.residual[:t], rows)

    @torch.inference_mode()
    def run_fused(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        rows: Sequence[int],
        cu: Sequence[int],
        lens: Sequence[int],
        tables: Sequence[Sequence[int]],
    ) -> torch.Tensor | None:
        """A step given as host lists (model_runner.prefill's), as fused pieces -> fp32 logits
        of `rows`; None when it has too many tokens or sequences for them."""
        n = self.bucket(len(ids))
        if n not in self.fused_sizes or len(lens) > FUSED_SEQS:
            return None
        if self._dense(n, len(lens) == 1 and lens[0] == len(ids)):
            return None  # `run`'s plain pieces with dense attention
        self.fused.load(n, ids, positions, slots, rows, cu, lens, tables)
        graphs = self._fused_graphs.get(n)
        for i in range(self.num_layers + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._fused_piece(n, i)
            if i < self.num_layers and self.on_layer_kv is not None:
                self.on_layer_kv(i)  # (layer i's KV and attention are done)
        self.num_steps += 1
        self.num_fused += 1
        self.num_replays += graphs is not None
        t = len(ids)
        return self.model.final_logits(
            self.hidden[:t], self.residual[:t], self.fused.rows[: len(rows)]
        )


def capture_prefill_graphs(
    runner, sizes: Sequence[int] | None, max_num_batched_tokens: int, pool=None
) -> PrefillGraphs | None:
    """Captures `runner`'s piecewise prefill graphs (sizes None: default_sizes of the budget)
    into `pool` and routes its bucketed steps through them; None where graphs do not apply
    (not CUDA, tensor parallel: followers replay commands eagerly, no sizes)."""
    if runner.device.type != "cuda" or runner.tp.enabled:
        return None
    wanted = graph_sizes(sizes, max_num_batched_tokens)
    if not wanted:
        return None
    graphs = PrefillGraphs(
        runner.model, runner.kv_cache, runner.cos_sin, wanted, runner.max_blocks_per_seq
    )
    with torch.cuda.device(runner.device):
        graphs.capture(pool)
    runner.prefill_graphs = graphs
    return graphs
