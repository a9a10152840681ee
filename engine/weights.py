"""Loads Hugging Face safetensors checkpoints (single file or sharded) into `CausalLM`.

Tensors are read lazily with `safe_open`, cast to the serving dtype and copied straight into
the model's fused parameters (q/k/v -> qkv, gate/up -> gate_up), one tensor at a time, so peak
host memory stays near one tensor. Under tensor parallelism each rank reads only its slices
(`get_slice`): its heads of q/k/v, its columns of gate/up, its input columns of o_proj/down,
its vocab rows of embed_tokens/lm_head (the last rank's padding rows past the vocab stay zero).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from splitserve.engine.model import CausalLM


class CheckpointError(ValueError):
    """The checkpoint folder is missing files or tensors, or holds tensors of the wrong shape."""


def _open(stack: ExitStack, f: Path):
    """safe_open, with a damaged or missing file as a CheckpointError naming it."""
    try:
        return stack.enter_context(safe_open(str(f), framework="pt"))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read {f}: {exc}") from None


def _shard_map(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index: {exc!r}") from None
        return {name: model_dir / shard for name, shard in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    names: dict[str, Path] = {}
    for f in files:
        with ExitStack() as stack:
            names.update(dict.fromkeys(_open(stack, f).keys(), f))
    return names


# A target: (destination parameter, row offset inside a fused parameter, this rank's rows of it,
# dim split over the tensor-parallel ranks or None for a replicated tensor, or VOCAB: rows split
# as CausalLM pads them). The rows are checked exactly: a tensor shorter than config.json
# implies would leave the rest of the parameter uninitialised (NaN logits), not fail.
VOCAB = "vocab"
Target = tuple[torch.Tensor, int, int, int | str | None]


def _targets(model: CausalLM) -> dict[str, Target]:
    """HF tensor name -> where this rank's part of it goes (model.tp picks the slice)."""
    cfg = model.cfg
    layer0 = model.layers[0]
    q, kv, inter = (
        layer0.q_size,
        layer0.kv_size,
        layer0.gate_up_weight.shape[0] // 2,
    )  # this rank's sizes
    vocab_rows = min(max(cfg.vocab_size - model.vocab_start, 0), model.embed.shape[0])

    def whole(param: torch.Tensor, split: int | None) -> Target:
        return (param, 0, param.shape[0], split)

    out: dict[str, Target] = {
        # tied: also the lm_head's slice
        "model.embed_tokens.weight": (model.embed, 0, vocab_rows, VOCAB),
        "model.norm.weight": whole(model.final_norm, None),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (model.lm_head, 0, vocab_rows, VOCAB)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = whole(layer.input_norm, None)
        out[p + "post_attention_layernorm.weight"] = whole(layer.post_attention_norm, None)
        for suffix, param in (("weight", layer.qkv_weight), ("bias", layer.qkv_bias)):
            if param is not None:  # column-parallel: this rank's heads of q, k and v
                out[p + f"self_attn.q_proj.{suffix}"] = (param, 0, q, 0)
                out[p + f"self_attn.k_proj.{suffix}"] = (param, q, kv, 0)
                out[p + f"self_attn.v_proj.{suffix}"] = (param, q + kv, kv, 0)
        if layer.o_weight is not None:  # row-parallel: this rank's input columns; bias whole
            out[p + "self_attn.o_proj.weight"] = whole(layer.o_weight, 1)
        if layer.o_bias is not None:
            out[p + "self_attn.o_proj.bias"] = whole(layer.o_bias, None)
        for suffix, param in (("weight", layer.gate_up_weight), ("bias", layer.gate_up_bias)):
            if param is not None:
                out[p + f"mlp.gate_proj.{suffix}"] = (param, 0, inter, 0)
                out[p + f"mlp.up_proj.{suffix}"] = (param, inter, inter, 0)
        out[p + "mlp.down_proj.weight"] = whole(layer.down_weight, 1)
        if layer.down_bias is not None:
            out[p + "mlp.down_proj.bias"] = whole(layer.down_bias, None)
    return out


def _read(handle, name: str, split: int | str | None, model: CausalLM) -> torch.Tensor:
    """The whole tensor, or this rank's 1/size of it along `split` (read lazily: only the slice)."""
    rank, size = model.tp.rank, model.tp.size
    sl = handle.get_slice(name)
    shape = sl.get_shape()
    if split == VOCAB and (not shape or shape[0] != model.cfg.vocab_size):
        raise CheckpointError(
            f"tensor {name} has {shape[0] if shape else 0} rows, config.json's vocab_size is "
            f"{model.cfg.vocab_size}"
        )
    if split is None or size == 1:
        return sl[:]
    if split == VOCAB:  # rows [start, start + rows) clipped to the vocab (the last rank: fewer)
        start, rows = model.vocab_start, model.embed.shape[0]
        return sl[min(start, shape[0]) : min(start + rows, shape[0])]
    if shape[split] % size:
        raise CheckpointError(
            f"tensor {name} has {shape[split]} rows/columns along dim {split}, "
            f"which {size} tensor-parallel ranks cannot split evenly"
        )
    part = shape[split] // size
    lo, hi = rank * part, (rank + 1) * part
    return sl[lo:hi] if split == 0 else sl[:, lo:hi]


def load_weights(model: CausalLM, model_dir: str | Path) -> None:
    model_dir = Path(model_dir)
    shards = _shard_map(model_dir)
    targets = _targets(model)
    source = {name: name for name in targets}
    tied = model.cfg.tie_word_embeddings
    if tied and "model.embed_tokens.weight" not in shards and "lm_head.weight" in shards:
        source["model.embed_tokens.weight"] = "lm_head.weight"  # tied, saved as the head only
    missing = sorted(name for name in targets if source[name] not in shards)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(
            f"checkpoint {model_dir} lacks tensors: {', '.join(missing[:3])}{more}"
        )
    rank, size = model.tp.rank, model.tp.size
    with ExitStack() as stack, torch.no_grad():
        handles = {f: _open(stack, f) for f in sorted(set(shards[source[n]] for n in targets))}
        for name, (param, offset, rows, split) in targets.items():
            src = source[name]
            try:
                tensor = _read(handles[shards[src]], src, split, model)
            except SafetensorError as exc:  # e.g. the index names a tensor its shard lacks
                raise CheckpointError(
                    f"cannot read tensor {src} from {shards[src]}: {exc}"
                ) from None
            dest = param.data[offset : offset + rows]
            if dest.shape != tensor.shape:
                what = f" (rank {rank} of {size})" if size > 1 else ""
                raise CheckpointError(
                    f"tensor {name}{what} has shape {tuple(tensor.shape)}, config.json implies "
                    f"{tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dest.dtype))
        if (
            tied
            and source["model.embed_tokens.weight"] != "lm_head.weight"
            and "lm_head.weight" in shards
        ):
            head_file = shards["lm_head.weight"]
            head = handles[head_file] if head_file in handles else _open(stack, head_file)
            _check_tied_head(head, model, model_dir)


TIED_CHECK_ROWS = 4096  # rows compared at a time: host memory stays near one such chunk


def _check_tied_head(handle, model: CausalLM, model_dir: Path) -> None:
    """config.json ties the output head to the embedding, yet the checkpoint has its own
    lm_head.weight: the same tensor is fine; a different one is refused, since loaders disagree
    on which wins (transformers 5 unties and uses it, vLLM ignores it). Compares this rank's
    vocab rows (already loaded into the embedding) a chunk at a time."""
    sl = handle.get_slice("lm_head.weight")
    shape = sl.get_shape()
    start, rows = model.vocab_start, model.embed.shape[0]
    end = min(start + rows, model.cfg.vocab_size)
    same = list(shape) == [model.cfg.vocab_size, model.embed.shape[1]]
    for lo in range(start, end, TIED_CHECK_ROWS):
        if not same:
            break
        hi = min(lo + TIED_CHECK_ROWS, end)
        loaded = model.embed.data[lo - start : hi - start]
        same = torch.equal(sl[lo:hi].to(device=loaded.device, dtype=loaded.dtype), loaded)
    if not same:
        raise CheckpointError(
            f"checkpoint {model_dir}: config.json sets tie_word_embeddings, but its "
            "lm_head.weight differs from model.embed_tokens.weight; set tie_word_embeddings "
            "to false to serve the separate head, or remove lm_head.weight to tie them"
        )
