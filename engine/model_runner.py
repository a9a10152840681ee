"""Runs the model over the paged cache: batched prefill of packed prompts and batched decode.

The runner owns the weights, the KV pool and the RoPE table. It builds the typed
`AttentionMetadata` from host lists and copies it to the device (pageable memory: see
`_to_device`; the decode loop's graph runner has its own pinned staging); it returns fp32
logits of the last token of each sequence. Block bookkeeping stays with the caller (the
schedulers), which passes block tables in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from splitserve.config.engine_config import EngineConfig, ModelConfig
from splitserve.config.hf_config import load_model_config
from splitserve.engine.attention_metadata import AttentionMetadata
from splitserve.engine.kv_cache import KVGeometry, allocate_kv_pool, choose_num_blocks, kv_geometry
from splitserve.engine.model import CausalLM
from splitserve.engine.parallel import SINGLE, TPGroup, rank_device
from splitserve.engine.rope import cos_sin_cache
from splitserve.engine.weights import load_weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PrefillChunk:
    """New tokens of one sequence; `num_computed` tokens of it are already in the cache."""

    token_ids: Sequence[int]
    num_computed: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class DecodeLane:
    """One token at `position` (= tokens already cached) of one running sequence."""

    token_id: int
    position: int
    block_table: Sequence[int]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    # CPU matmuls in bf16 are slow and lossy; tests compare fp32 against transformers.
    return torch.float32 if device.type == "cpu" else _DTYPES[model.dtype]


_SAMPLE_BYTES = 1 << 16


def model_compat_hash(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, block_size: int
) -> str:
    """Identity of what a KV block means: geometry, dtype, block size and the weights.

    The weights enter through each file's size, its safetensors header (names, shapes, offsets)
    and three 64 KiB samples of its contents, so two fine-tunes of one base differ, without
    reading gigabytes at start-up."""
    h = hashlib.sha256(json.dumps(cfg.model_dump(), sort_keys=True).encode())
    h.update(f"{dtype}|{block_size}".encode())
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(header_len, 1 << 24)))
            for offset in (8 + header_len, (size + header_len) // 2, size - _SAMPLE_BYTES):
                fh.seek(max(0, offset))
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()[:32]


class ModelRunner:
    """`tp`: this process's rank of a tensor-parallel worker (engine/parallel.py); its model holds
    the rank's slices and its pool the rank's KV heads. `mirror`, set on rank 0 of such a worker,
    receives every call that runs the model or writes the pool, before it runs here, so the
    followers run the same (decode_worker / prefill_worker tp_follower.py)."""

    def __init__(self, cfg: EngineConfig, tp: TPGroup = SINGLE) -> None:
        self.engine_config = cfg
        self.model_config = load_model_config(cfg.model_path)
        self.model_config.check_tensor_parallel(cfg.parallel.tensor_parallel_size)
        if cfg.parallel.tensor_parallel_size != tp.size:
            raise ValueError(
                f"parallel.tensor_parallel_size is {cfg.parallel.tensor_parallel_size} but this "
                f"process group has {tp.size} ranks; start tensor-parallel runners through a worker "
                "(--tensor-parallel-size), which spawns every rank"
            )
        self.tp = tp
        self.mirror = None  # Callable[[tuple], None] on rank 0 of a tensor-parallel worker
        # engine/prefill_graphs.PrefillGraphs: bucketed, piecewise-captured prefill steps
        self.prefill_graphs = None
        self.device = resolve_device(cfg.device)
        if tp.enabled:
            self.device = rank_device(self.device, tp.rank)
        self.dtype = resolve_dtype(cfg.dtype, self.model_config, self.device)
        mc = self.model_config
        self.max_model_len = cfg.scheduler.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"scheduler.max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {mc.max_position_embeddings}; lower it"
            )
        torch.manual_seed(cfg.seed)
        self.model = CausalLM(mc, self.dtype, self.device, tp)
        load_weights(self.model, cfg.model_path)
        self.model.eval()
        self.geometry: KVGeometry = kv_geometry(mc, cfg.cache, self.dtype, tp.size)
        self.block_size = cfg.cache.block_size
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        reserve = 2**30 if self.device.type == "cuda" else 0  # activations and graphs
        self.num_blocks = choose_num_blocks(self.geometry, cfg.cache, self.device, reserve)
        if tp.enabled:  # block ids mean the same on every rank: all pools get the smallest size
            n = torch.tensor([self.num_blocks])
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN, group=tp.cpu_group)
            self.num_blocks = int(n)
        self.kv_cache = allocate_kv_pool(self.geometry, self.num_blocks, self.device)
        self.cos_sin = cos_sin_cache(mc, self.max_model_len, self.device)
        # the same on every rank and for every tensor_parallel_size: the handle's shard map says
        # which heads sit where, so a TP2 prefill can hand over to a TP1 decode worker
        self.compat_hash = model_compat_hash(cfg.model_path, mc, self.dtype, self.block_size)

    @property
    def kv_head_range(self) -> tuple[int, int]:
        """[start, end) of the model's KV heads that this rank's pool holds."""
        return self.tp.shard(self.model_config.num_key_value_heads)

    # ---- host -> device -------------------------------------------------------------------
    def _to_device(self, data, dtype: torch.dtype) -> torch.Tensor:
        # Pageable on purpose: pinning a fresh buffer per call costs a page-locked allocation
        # (milliseconds); the decode loop's graph runner keeps reusable pinned buffers instead.
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def _to_device_packed(self, segments: Sequence, dtype: torch.dtype) -> list:
        """Several int arrays / lists in one H2D copy (a copy costs about as much as its
        launch); each segment starts 16-byte aligned, as a tensor of its own would (Triton
        specialises kernels on pointer alignment: a misaligned one would compile a new variant
        while serving). Built with numpy: Python loops over an 8k-token step took ~2 ms."""
        np_dtype = np.int64 if dtype == torch.int64 else np.int32
        step = 16 // np.dtype(np_dtype).itemsize
        parts, spans, at = [], [], 0
        for seg in segments:
            arr = np.asarray(seg, dtype=np_dtype)
            spans.append((at, arr.size))
            parts += [arr, np.zeros(-arr.size % step, dtype=np_dtype)]
            at += arr.size + parts[-1].size
        packed = torch.from_numpy(np.concatenate(parts)).to(self.device, non_blocking=True)
        return [packed[start : start + n] for start, n in spans]

    def _block_tables(self, tables: Sequence[Sequence[int]], width: int) -> torch.Tensor:
        return self._to_device([list(t) + [0] * (width - len(t)) for t in tables], torch.int32)

    def _slots(self, table: Sequence[int], start: int, stop: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    def _step_arrays(self, chunks: Sequence[PrefillChunk]) -> tuple[np.ndarray, ...]:
        """(token ids, positions, KV slots) of a prefill step, as int64 arrays."""
        bs, ids, pos, slots = self.block_size, [], [], []
        for c in chunks:
            ids.append(np.asarray(c.token_ids, dtype=np.int64))
            p = np.arange(c.num_computed, c.num_computed + len(c.token_ids), dtype=np.int64)
            pos.append(p)
            slots.append(np.asarray(c.block_table, dtype=np.int64)[p // bs] * bs + p % bs)
        return tuple(np.concatenate(a) for a in (ids, pos, slots))

    def _check_table(self, table: Sequence[int], length: int) -> None:
        if len(table) * self.block_size < length:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {length} tokens")

    # ---- steps ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Computes each chunk's tokens into the cache; returns [B, V] logits of each last token."""
        cu, lens = [0], []
        for c in chunks:
            end = c.num_computed + len(c.token_ids)
            if not c.token_ids:
                raise ValueError("a prefill chunk needs at least one token")
            self._check_table(c.block_table, end)
            cu.append(cu[-1] + len(c.token_ids))
            lens.append(end)
        ids, pos, slots = self._step_arrays(chunks)
        width = max(len(c.block_table) for c in chunks)
        if (
            self.mirror is not None
        ):  # after validation: a refused call must not run on one rank only
            self.mirror(
                (
                    "prefill",
                    [
                        PrefillChunk(list(c.token_ids), c.num_computed, tuple(c.block_table))
                        for c in chunks
                    ],
                )
            )  # snapshots: the caller's lists may grow
        last_rows = [c - 1 for c in cu[1:]]  # each chunk's last token: its logits row
        if self.prefill_graphs is not None:  # few sequences: fused pieces (prefill_graphs.py)
            tables = [c.block_table for c in chunks]
            logits = self.prefill_graphs.run_fused(ids, pos, slots, last_rows, cu, lens, tables)
            if logits is not None:
                return logits
        # two copies per step: the int64 lists, then the int32 ones
        ids_d, pos_d, slots_d, last = self._to_device_packed(
            [ids, pos, slots, last_rows], torch.int64
        )
        padded = [list(c.block_table) + [0] * (width - len(c.block_table)) for c in chunks]
        tables, lens_d, cu_d = self._to_device_packed(
            [[b for r in padded for b in r], lens, cu], torch.int32
        )
        meta = AttentionMetadata(
            slot_mapping=slots_d,
            block_tables=tables.view(len(chunks), width),
            context_lens=lens_d,
            is_prefill=True,
            cu_seqlens_q=cu_d,
            max_query_len=max(len(c.token_ids) for c in chunks),
            dense_causal=len(chunks) == 1 and chunks[0].num_computed == 0,
        )
        if self.prefill_graphs is not None and self.prefill_graphs.bucket(len(ids)):
            # padded to a bucket, replayed (prefill_graphs.py)
            return self.prefill_graphs.run(ids_d, pos_d, slots_d, meta, last)
        return self.model.logits(
            ids_d,
            pos_d,
            self.kv_cache,
            self.cos_sin,
            meta,
            rows=last,
        )

    @torch.inference_mode()
    def decode(self, lanes: Sequence[DecodeLane]) -> torch.Tensor:
        """One token per sequence; returns [B, V] logits."""
        for lane in lanes:
            self._check_table(lane.block_table, lane.position + 1)
        if self.mirror is not None:
            self.mirror(
                (
                    "decode",
                    [
                        DecodeLane(lane.token_id, lane.position, tuple(lane.block_table))
                        for lane in lanes
                    ],
                )
            )
        meta = AttentionMetadata(
            slot_mapping=self._to_device(
                [
                    self._slots(lane.block_table, lane.position, lane.position + 1)[0]
                    for lane in lanes
                ],
                torch.int64,
            ),
            block_tables=self._block_tables(
                [lane.block_table for lane in lanes], max(len(lane.block_table) for lane in lanes)
            ),
            context_lens=self._to_device([lane.position + 1 for lane in lanes], torch.int32),
            is_prefill=False,
        )
        return self.model.logits(
            self._to_device([lane.token_id for lane in lanes], torch.int64),
            self._to_device([lane.position for lane in lanes], torch.int64),
            self.kv_cache,
            self.cos_sin,
            meta,
        )

    def zero_kv(self) -> None:
        """Clears what warm-up wrote so no stale value can be read as context."""
        if self.mirror is not None:
            self.mirror(("zero_kv",))
        self.kv_cache.zero_()
