"""Checkpoint loading: sharded equals single-file; missing or misshapen tensors are named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.cli.make_model import make_model
from splitserve.config.engine_config import EngineConfig
from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.weights import CheckpointError


def _logits(folder):
    runner = ModelRunner(EngineConfig(model_path=str(folder), cache={"num_blocks": 8}))
    return runner.prefill([PrefillChunk([1, 50, 60, 70], 0, [1])])


def test_sharded_checkpoint_loads_the_same(tmp_path, tiny_llama):
    sharded = make_model("tiny", tmp_path / "sharded", max_shard_bytes=64 * 1024)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    torch.testing.assert_close(_logits(sharded), _logits(tiny_llama), atol=0, rtol=0)


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    folder = make_model("tiny", tmp_path / "broken")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        _logits(folder)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj.weight has shape"):
        _logits(folder)


def test_make_model_is_deterministic(tmp_path):
    a = make_model("tiny-qwen2", tmp_path / "a", seed=3)
    b = make_model("tiny-qwen2", tmp_path / "b", seed=3)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize(
    "name",
    [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    ],
)
def test_a_tensor_shorter_than_config_json_implies_is_refused(tmp_path, name):
    # one row short: the rest of the parameter would keep uninitialised memory (NaN logits)
    folder = make_model("tiny", tmp_path / "short")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"{name.replace('.', '[.]')} has (shape|511 rows)"):
        _logits(folder)


def _tie(folder, head):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = head(tensors["model.embed_tokens.weight"]).clone()
    save_file(tensors, str(folder / "model.safetensors"))


def test_tied_config_with_a_different_lm_head_is_refused_and_an_equal_one_loads(tmp_path):
    same = make_model("tiny", tmp_path / "same")
    _tie(same, lambda embed: embed)
    assert torch.isfinite(_logits(same)).all()
    other = make_model("tiny", tmp_path / "other")
    _tie(other, lambda embed: embed + 1)
    with pytest.raises(CheckpointError, match="tie_word_embeddings.*lm_head.weight differs"):
        _logits(other)


def test_damaged_files_are_a_checkpoint_error_naming_them(tmp_path):
    folder = make_model("tiny", tmp_path / "damaged", max_shard_bytes=64 * 1024)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"]["model.norm.weight"]
    # the index names a tensor its shard does not hold
    index["weight_map"]["model.layers.0.mlp.up_proj.weight"] = shard.name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.up_proj.weight"):
        _logits(folder)
    shard.write_bytes(b"\x00not a safetensors file")
    with pytest.raises(CheckpointError, match=f"cannot read .*{shard.name}"):
        _logits(folder)


def test_a_tied_checkpoint_saved_as_its_head_only_loads(tmp_path):
    # transformers ties to whichever of the two a checkpoint holds
    embed_only = make_model("tiny", tmp_path / "embed")
    _tie(embed_only, lambda embed: embed)
    head_only = make_model("tiny", tmp_path / "head")
    _tie(head_only, lambda embed: embed)
    tensors = load_file(str(head_only / "model.safetensors"))
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, str(head_only / "model.safetensors"))
    torch.testing.assert_close(_logits(head_only), _logits(embed_only), atol=0, rtol=0)
