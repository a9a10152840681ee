"""Reads a Hugging Face `config.json` into a `ModelConfig`, refusing what the engine can't honour.

Every field that changes the math is either mapped or refused with a clear error: an
unsupported architecture, activation, RoPE scaling type or sliding window never loads silently.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from splitserve.config.engine_config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from splitserve.config.files import format_validation_error

log = logging.getLogger("splitserve.config")


class UnsupportedModelError(ValueError):
    """The checkpoint needs something the engine does not implement."""


_TORCH_DTYPES = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "fp32": "float32",
}


# transformers' defaults for keys a config.json may leave out (its config classes' values)
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 131072,
    "Qwen2ForCausalLM": 32768,
}
_MISTRAL_DEFAULT_WINDOW = 4096
# num_key_value_heads when config.json leaves it out (None: num_attention_heads)
_DEFAULT_KV_HEADS = {"LlamaForCausalLM": None, "MistralForCausalLM": 8, "Qwen2ForCausalLM": 32}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")


def _rope(raw: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling]:
    """RoPE as transformers 5 reads it: `rope_scaling` (older spelling) taken whole when given,
    else `rope_parameters`; theta from that dict, else the top-level `rope_theta`; a top-level
    `original_max_position_embeddings` wins over the dict's, which defaults to
    max_position_embeddings."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise UnsupportedModelError(
            f"rope_scaling / rope_parameters must be an object, got {params!r}"
        )
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type rope_parameters are not supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:  # transformers applies it in there too
        raise UnsupportedModelError("partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return theta, RopeScaling()
    if params.get("factor") is None:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} needs a factor in config.json"
        )
    fields = {
        k: params[k]
        for k in ("factor", "low_freq_factor", "high_freq_factor")
        if params.get(k) is not None
    }
    if rope_type == "llama3":
        fields["original_max_position_embeddings"] = raw.get(
            "original_max_position_embeddings",
            params.get("original_max_position_embeddings") or max_positions,
        )
    else:
        fields = {"factor": fields["factor"]}
    return theta, RopeScaling(rope_type=rope_type, **fields)


def _sliding_window(raw: dict[str, Any], arch: str, max_positions: int, layers: int) -> None:
    """Refuses a window some layer applies (transformers' rules per architecture) where a
    sequence can outgrow it; Llama has no window, whatever its config.json says."""
    if arch == "MistralForCausalLM":  # no switch; a missing key means transformers' 4096
        window = raw.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
    elif arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window", False):
        window = raw.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
        kinds = raw.get("layer_types") or [
            "sliding_attention" if i >= raw.get("max_window_layers", 28) else "full_attention"
            for i in range(layers)
        ]
        window = window if "sliding_attention" in kinds else None
    else:
        return
    if window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool):
        raise UnsupportedModelError(f"sliding_window must be an integer or null, got {window!r}")
    if window < max_positions:
        raise UnsupportedModelError(
            f"sliding-window attention (sliding_window={window}, max_position_embeddings="
            f"{max_positions}) is not supported; use a checkpoint with sliding_window null"
        )


def parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    try:
        return _parse(raw)
    except ValidationError as exc:
        raise UnsupportedModelError(format_validation_error(exc, "config.json")) from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, UnsupportedModelError):
            raise
        raise UnsupportedModelError(f"config.json has a value of the wrong type: {exc}") from None


def _parse(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; splitserve serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    missing = [k for k in (*_REQUIRED, "num_attention_heads") if raw.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"config.json lacks {', '.join(missing)}")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' swish is SiLU
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
    max_positions = raw.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[arch]
    _sliding_window(raw, arch, max_positions, raw["num_hidden_layers"])
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            "partial_rotary_factor != 1.0 is not supported for this architecture"
        )
    heads = raw["num_attention_heads"]
    theta, scaling = _rope(raw, max_positions)
    eos_ids = _ids(raw.get("eos_token_id"), "config.json")
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    if dtype not in _TORCH_DTYPES:
        raise UnsupportedModelError(
            f"checkpoint dtype {dtype!r} is not supported (float32, bfloat16, float16)"
        )
    # biases as transformers builds each architecture: Llama's attention_bias (q/k/v/o) and
    # mlp_bias are honoured; Qwen2 always has q/k/v bias only; Mistral none (its flags ignored)
    is_llama, is_qwen2 = arch == "LlamaForCausalLM", arch == "Qwen2ForCausalLM"
    attention_bias = is_llama and bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or _DEFAULT_KV_HEADS[arch] or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else attention_bias,
        o_proj_bias=False if is_qwen2 else attention_bias,
        mlp_bias=is_llama and bool(raw.get("mlp_bias", False)),
        dtype=_TORCH_DTYPES[dtype],
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise UnsupportedModelError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{path} must hold a JSON object")
    return raw


def _ids(value: Any, where: str) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise UnsupportedModelError(f"{where}: eos_token_id must be token ids, got {value!r}")
    return tuple(ids)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """config.json, with generation_config.json's eos ids added to the stop ids (as
    transformers' generate and vLLM do: Llama 3 Instruct ends turns with <|eot_id|>, named
    there only in some checkpoints)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no config.json in {model_dir}: pass a Hugging Face checkpoint folder"
        )
    cfg = parse_hf_config(_read_json(path))
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:  # as transformers: a broken one is reported and left out, not fatal
            extra = _ids(_read_json(gen).get("eos_token_id"), str(gen))
        except UnsupportedModelError as exc:
            log.warning("%s; its eos ids are not used", exc)
            return cfg
        eos = cfg.eos_token_ids + tuple(i for i in extra if i not in cfg.eos_token_ids)
        cfg = cfg.model_copy(update={"eos_token_ids": eos})
    return cfg
