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
