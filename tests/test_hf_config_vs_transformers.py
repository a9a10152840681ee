"""config.json read as transformers reads it (the oracle): RoPE spellings and precedence,
sliding windows per architecture, per-architecture biases and defaults."""

from __future__ import annotations

import pytest
import torch

from splitserve.cli.make_model import PRESETS
from splitserve.config.hf_config import UnsupportedModelError, parse_hf_config
from splitserve.engine.rope import inverse_frequencies

transformers = pytest.importorskip("transformers")
BASE = {**PRESETS["tiny"], "hidden_act": "silu", "rope_scaling": None}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _hf_inv_freq(raw: dict) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    kind = cfg.rope_parameters["rope_type"]
    if kind == "default":
        return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg).inv_freq
    return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")[0]


@pytest.mark.parametrize(
    "change",
    [
        # a top-level original_max_position_embeddings wins over the dict's
        {
            "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 64},
            "original_max_position_embeddings": 16,
        },
        # none at all: max_position_embeddings
        {"rope_scaling": LLAMA3},
        # both spellings: rope_scaling taken whole, theta from the top level
        {
            "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 64},
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "rope_theta": 5e5,
        },
        {
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "rope_theta": 5e5,
        },
        {"rope_theta": 5e5},
    ],
)
def test_rope_frequencies_match_transformers(change):
    raw = {**BASE, "max_position_embeddings": 256, **change}
    torch.testing.assert_close(inverse_frequencies(parse_hf_config(raw)), _hf_inv_freq(raw))


def test_partial_rotary_inside_the_rope_dict_is_refused():
    rope = {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        parse_hf_config({**BASE, "rope_parameters": rope})


def test_missing_kv_heads_default_per_architecture():
    raw = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
    for arch, cls in (("MistralForCausalLM", "MistralConfig"), ("Qwen2ForCausalLM", "Qwen2Config")):
        want = getattr(transformers, cls)().num_key_value_heads
        got = parse_hf_config(
            {
                **raw,
                "num_attention_heads": 32,
                "hidden_size": 2048,
                "architectures": [arch],
                "sliding_window": None,
            }
        )
        assert got.num_key_value_heads == want
    assert parse_hf_config(raw).num_key_value_heads == raw["num_attention_heads"]


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_scaled_rope_without_a_factor_is_refused(kind):
    params = {k: v for k, v in LLAMA3.items() if k != "factor"} | {"rope_type": kind}
    with pytest.raises(UnsupportedModelError, match="needs a factor"):
        parse_hf_config({**BASE, "rope_scaling": params})


MISTRAL = {**BASE, "architectures": ["MistralForCausalLM"], "max_position_embeddings": 4096}
QWEN2 = {**BASE, "architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 4096}


@pytest.mark.parametrize(
    "raw",
    [
        {
            k: v for k, v in MISTRAL.items() if k != "max_position_embeddings"
        },  # window 4096 < 131072
        {**MISTRAL, "sliding_window": 32, "use_sliding_window": False},  # Mistral has no switch
        {
            **{k: v for k, v in MISTRAL.items() if k != "max_position_embeddings"},
            "sliding_window": 4096,
        },
        {**QWEN2, "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
        {
            **QWEN2,
            "use_sliding_window": True,
            "sliding_window": 32,
            "layer_types": ["full_attention", "sliding_attention"],
        },
    ],
)
def test_a_window_some_layer_applies_is_refused(raw):
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        parse_hf_config(raw)


@pytest.mark.parametrize(
    "raw",
    [
        {**MISTRAL, "sliding_window": None},
        {**MISTRAL, "sliding_window": 4096},  # never outgrown
        {**QWEN2, "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 28},
        {**QWEN2, "use_sliding_window": False, "sliding_window": 32},
        {**BASE, "sliding_window": 32, "use_sliding_window": True},  # Llama has no window
    ],
)
def test_a_window_no_layer_applies_loads(raw):
    assert parse_hf_config(raw).architecture == raw["architectures"][0]


def test_biases_and_defaults_per_architecture():
    flags = {"attention_bias": True, "mlp_bias": True}
    llama = parse_hf_config({**BASE, **flags})
    assert llama.qkv_bias and llama.o_proj_bias and llama.mlp_bias
    mistral = parse_hf_config({**MISTRAL, **flags, "sliding_window": None})
    assert not (mistral.qkv_bias or mistral.o_proj_bias or mistral.mlp_bias)
    qwen2 = parse_hf_config({**QWEN2, **flags})
    assert qwen2.qkv_bias and not (qwen2.o_proj_bias or qwen2.mlp_bias)
    for arch, cls in (("LlamaForCausalLM", "LlamaConfig"), ("Qwen2ForCausalLM", "Qwen2Config")):
        raw = {k: v for k, v in BASE.items() if k != "max_position_embeddings"}
        got = parse_hf_config({**raw, "architectures": [arch]}).max_position_embeddings
        assert got == getattr(transformers, cls)().max_position_embeddings
    assert parse_hf_config({**BASE, "hidden_act": "swish"}).architecture == "LlamaForCausalLM"
