"""Loads Hugging Face safetensors checkpoints (single file or sharded) into `CausalLM`.

Tensors are read lazily with `safe_open`, cast to the serving dtype and copied straight into
the model's fused parameters (q/k/v -> qkv, gate/up -> gate_up), one tensor at a time, so peak
host memory stays near one tensor.
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


def _targets(model: CausalLM) -> dict[str, tuple[torch.Tensor, int]]:
    """HF tensor name -> (destination parameter, row offset inside a fused parameter)."""
    cfg = model.cfg
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out: dict[str, tuple[torch.Tensor, int]] = {
        "model.embed_tokens.weight": (model.embed, 0),
        "model.norm.weight": (model.final_norm, 0),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (model.lm_head, 0)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (layer.input_norm, 0)
        out[p + "post_attention_layernorm.weight"] = (layer.post_attention_norm, 0)
        for suffix, param in (("weight", layer.qkv_weight), ("bias", layer.qkv_bias)):
            if param is not None:
                out[p + f"self_attn.q_proj.{suffix}"] = (param, 0)
                out[p + f"self_attn.k_proj.{suffix}"] = (param, q)
                out[p + f"self_attn.v_proj.{suffix}"] = (param, q + kv)
        for suffix, param in (("weight", layer.o_weight), ("bias", layer.o_bias)):
            if param is not None:
                out[p + f"self_attn.o_proj.{suffix}"] = (param, 0)
        for suffix, param in (("weight", layer.gate_up_weight), ("bias", layer.gate_up_bias)):
            if param is not None:
                out[p + f"mlp.gate_proj.{suffix}"] = (param, 0)
                out[p + f"mlp.up_proj.{suffix}"] = (param, inter)
        for suffix, param in (("weight", layer.down_weight), ("bias", layer.down_bias)):
            if param is not None:
                out[p + f"mlp.down_proj.{suffix}"] = (param, 0)
    return out


def load_weights(model: CausalLM, model_dir: str | Path) -> None:
    model_dir = Path(model_dir)
    shards = _shard_map(model_dir)
    targets = _targets(model)
    missing = sorted(set(targets) - set(shards))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint {model_dir} lacks tensors: {', '.join(missing[:3])}{more}")
    with ExitStack() as stack, torch.no_grad():
        handles = {
            f: stack.enter_context(safe_open(str(f), framework="pt")) for f in sorted(set(shards[n] for n in targets))
        }
        for name, (param, offset) in targets.items():
            tensor = handles[shards[name]].get_tensor(name)
            rows = tensor.shape[0]
            dest = param.data[offset : offset + rows]
            if dest.shape != tensor.shape:
                raise CheckpointError(
                    f"tensor {name} has shape {tuple(tensor.shape)}, config.json implies {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dest.dtype))
