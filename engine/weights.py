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
from safetensors import safe_open

from splitserve.engine.model import CausalLM


class CheckpointError(ValueError):
    """The checkpoint folder is missing files or tensors, or holds tensors of the wrong shape."""


def _shard_map(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / shard for name, shard in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), f))
    return names


# A target: (destination parameter, row offset inside a fused parameter, dim split over the
# tensor-parallel ranks or None for a replicated tensor, or VOCAB: rows split as CausalLM pads them).
VOCAB = "vocab"
Target = tuple[torch.Tensor, int, int | str | None]


def _targets(model: CausalLM) -> dict[str, Target]:
    """HF tensor name -> where this rank's part of it goes (model.tp picks the slice)."""
    cfg = model.cfg
    layer0 = model.layers[0]
    q, kv, inter = (
        layer0.q_size,
        layer0.kv_size,
        layer0.gate_up_weight.shape[0] // 2,
    )  # this rank's sizes
    out: dict[str, Target] = {
        "model.embed_tokens.weight": (model.embed, 0, VOCAB),  # tied: also the lm_head's slice
        "model.norm.weight": (model.final_norm, 0, None),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (model.lm_head, 0, VOCAB)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (layer.input_norm, 0, None)
        out[p + "post_attention_layernorm.weight"] = (layer.post_attention_norm, 0, None)
        for suffix, param in (("weight", layer.qkv_weight), ("bias", layer.qkv_bias)):
            if param is not None:  # column-parallel: this rank's heads of q, k and v
                out[p + f"self_attn.q_proj.{suffix}"] = (param, 0, 0)
                out[p + f"self_attn.k_proj.{suffix}"] = (param, q, 0)
                out[p + f"self_attn.v_proj.{suffix}"] = (param, q + kv, 0)
        if layer.o_weight is not None:  # row-parallel: this rank's input columns; bias whole
            out[p + "self_attn.o_proj.weight"] = (layer.o_weight, 0, 1)
        if layer.o_bias is not None:
            out[p + "self_attn.o_proj.bias"] = (layer.o_bias, 0, None)
        for suffix, param in (("weight", layer.gate_up_weight), ("bias", layer.gate_up_bias)):
            if param is not None:
                out[p + f"mlp.gate_proj.{suffix}"] = (param, 0, 0)
                out[p + f"mlp.up_proj.{suffix}"] = (param, inter, 0)
        out[p + "mlp.down_proj.weight"] = (layer.down_weight, 0, 1)
        if layer.down_bias is not None:
            out[p + "mlp.down_proj.bias"] = (layer.down_bias, 0, None)
    return out


def _read(handle, name: str, split: int | str | None, model: CausalLM) -> torch.Tensor:
    """The whole tensor, or this rank's 1/size of it along `split` (read lazily: only the slice)."""
    rank, size = model.tp.rank, model.tp.size
    if split is None or size == 1:
        return handle.get_tensor(name)
    sl = handle.get_slice(name)
    shape = sl.get_shape()
    if (
        split == VOCAB
    ):  # rows [start, start + rows) clipped to the vocab (the last rank may get fewer)
        if shape[0] != model.cfg.vocab_size:
            raise CheckpointError(
                f"tensor {name} has {shape[0]} rows, config.json's vocab_size is "
                f"{model.cfg.vocab_size}"
            )
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
    missing = sorted(set(targets) - set(shards))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(
            f"checkpoint {model_dir} lacks tensors: {', '.join(missing[:3])}{more}"
        )
    rank, size = model.tp.rank, model.tp.size
    with ExitStack() as stack, torch.no_grad():
        handles = {
            f: stack.enter_context(safe_open(str(f), framework="pt"))
            for f in sorted(set(shards[n] for n in targets))
        }
        for name, (param, offset, split) in targets.items():
            tensor = _read(handles[shards[name]], name, split, model)
            rows = tensor.shape[0]
            dest = param.data[offset : offset + rows]
            if dest.shape != tensor.shape:
                what = f" (rank {rank} of {size})" if size > 1 else ""
                raise CheckpointError(
                    f"tensor {name}{what} has shape {tuple(tensor.shape)}, config.json implies {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dest.dtype))
