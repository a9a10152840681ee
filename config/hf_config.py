"""Reads a Hugging Face `config.json` into a `ModelConfig`, refusing what the engine can't honour.

Every field that changes the math is either mapped or refused with a clear error: an
unsupported architecture, activation, RoPE scaling type or sliding window never loads silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from splitserve.config.engine_config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling


class UnsupportedModelError(ValueError):
    """The checkpoint needs something the engine does not implement."""


_TORCH_DTYPES = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "fp32": "float32",
}


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs use
    # `rope_theta` + `rope_scaling`. Both spellings of the type key exist in the wild.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = {**params, **scaling}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)"
        )
    fields = {
        k: merged[k]
        for k in (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        )
        if merged.get(k) is not None
    }
    if rope_type == "default":
        fields = {}
    return theta, RopeScaling(rope_type=rope_type, **fields)


def parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; splitserve serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", arch == "MistralForCausalLM")
    if window is not None and uses_window and window < raw.get("max_position_embeddings", 0):
        raise UnsupportedModelError(
            f"sliding-window attention (sliding_window={window}) is not supported; "
            "use a checkpoint with sliding_window null"
        )
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            "partial_rotary_factor != 1.0 is not supported for this architecture"
        )
    heads = raw["num_attention_heads"]
    theta, scaling = _rope(raw)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    if dtype not in _TORCH_DTYPES:
        raise UnsupportedModelError(
            f"checkpoint dtype {dtype!r} is not supported (float32, bfloat16, float16)"
        )
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias and no o_proj bias; Llama's attention_bias covers all four.
        qkv_bias=True if is_qwen2 else attention_bias,
        o_proj_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        dtype=_TORCH_DTYPES[dtype],
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no config.json in {model_dir}: pass a Hugging Face checkpoint folder"
        )
    return parse_hf_config(json.loads(path.read_text()))
