"""Config fields that change the math are honoured or refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from splitserve.cli.make_model import PRESETS
from splitserve.config.engine_config import CacheConfig, EngineConfig
from splitserve.config.hf_config import UnsupportedModelError, load_model_config, parse_hf_config
from splitserve.engine.rope import inverse_frequencies

BASE = {**PRESETS["tiny"], "hidden_act": "silu"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, "sliding-window"),
        ({"torch_dtype": "float8_e4m3fn"}, "dtype"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_fields_refused(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_hf_config({**BASE, **change})


def test_invalid_geometry_names_the_field_in_one_line():
    for change, field in (
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"intermediate_size": None}, "lacks intermediate_size"),
        ({"sliding_window": "4096", "architectures": ["MistralForCausalLM"]}, "sliding_window"),
        ({"rms_norm_eps": "tiny"}, "rms_norm_eps"),
    ):
        with pytest.raises(UnsupportedModelError, match=field) as info:
            parse_hf_config({**BASE, **change})
        assert "\n" not in str(info.value) and "http" not in str(info.value), str(info.value)
    with pytest.raises(ValidationError, match="block_size"):
        CacheConfig(block_size=12)
    with pytest.raises(ValidationError, match="extra"):
        EngineConfig(model_path="x", cache={"blocksize": 16})


def test_rope_scaling_spellings_and_math():
    new_style = parse_hf_config(
        {
            **BASE,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
        }
    )
    assert new_style.rope_theta == 5e5 and new_style.rope_scaling.rope_type == "linear"
    plain = parse_hf_config({**BASE, "rope_scaling": None, "rope_theta": 5e5})
    torch.testing.assert_close(inverse_frequencies(new_style), inverse_frequencies(plain) / 2.0)
    llama3 = parse_hf_config(BASE)
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        **{k: v for k, v in BASE.items() if k not in ("architectures",)}
    )
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(inverse_frequencies(llama3), ref)


def test_qwen2_bias_and_tied_head(tiny_qwen2):
    cfg = load_model_config(tiny_qwen2)
    assert cfg.qkv_bias and not cfg.o_proj_bias and cfg.tie_word_embeddings


def test_missing_config_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert load_model_config(tmp_path).architecture == "LlamaForCausalLM"


def test_generation_config_eos_ids_join_the_stop_ids(tmp_path, caplog):
    # Llama 3 Instruct style: <|eot_id|> named only in generation_config.json
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert load_model_config(tmp_path).eos_token_ids == (2, 7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_model_config(tmp_path).eos_token_ids == (2, 5)
    for bad, message in (('{"eos_token_id": "x"}', "token ids"), ("{not json", "not valid JSON")):
        (tmp_path / "generation_config.json").write_text(bad)
        with caplog.at_level("WARNING", logger="splitserve.config"):
            assert load_model_config(tmp_path).eos_token_ids == (2,)  # left out, as transformers
        assert message in caplog.text
