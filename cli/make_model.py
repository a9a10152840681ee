"""Writes deterministic random checkpoints in Hugging Face layout (config.json + safetensors +
a byte-level tokenizer), so tests and benchmarks need no download.

Presets: `tiny` / `tiny-qwen2` (CPU tests: fp32, hidden 64, a few layers) and shape copies of
public configs (`llama-3.2-1b`, `llama-3.1-8b`, `qwen2.5-0.5b`, bf16) for GPU benchmarks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from splitserve.cli.presets import PRESETS, TOKENIZER_VOCAB
from splitserve.cli.tiny_tokenizer import write_byte_level_tokenizer
from splitserve.request.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    qwen = cfg["model_type"] == "qwen2"
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if qwen:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return shapes


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    # 1/sqrt(fan_in) keeps activations O(1) at any width, so greedy choices have clear margins;
    # the embedding gets the same scale so a tied lm_head is not dominated by the input token.
    return torch.randn(shape, generator=gen) / shape[-1] ** 0.5


def make_model(
    preset: str,
    folder: str | Path,
    seed: int = 0,
    max_shard_bytes: int = 2 * 2**30,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_byte_level_tokenizer(folder, TOKENIZER_VOCAB)
    tok = Tokenizer.from_dir(folder)
    cfg = {
        **PRESETS[preset],
        "hidden_act": "silu",
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "attention_bias": False,
    }
    dtype = _DTYPES[cfg["torch_dtype"]]
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    shapes = _tensor_shapes(cfg)
    for i, (name, shape) in enumerate(shapes.items()):
        t = _init(name, shape, gen).to(dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        if progress:
            progress(i + 1, len(shapes))
    for old in folder.glob("*.safetensors"):
        old.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / fname), metadata=meta)
            weight_map |= dict.fromkeys(shard, fname)
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True)
        )
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}, indent=2)
    )
    return folder
