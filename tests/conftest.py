"""Shared pytest set-up: the `gpu` marker skips without CUDA; without CUDA, Triton kernels
run in Triton's interpreter (set before any kernel module is decorated with @triton.jit)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """The `tiny` Llama checkpoint (llama3 RoPE scaling, untied head), written once per run."""
    from splitserve.cli.make_model import make_model

    return make_model("tiny", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """The `tiny-qwen2` checkpoint (q/k/v bias, tied embeddings)."""
    from splitserve.cli.make_model import make_model

    return make_model("tiny-qwen2", tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture
def zero_kv_calls(monkeypatch) -> list[int]:
    """A list that grows by one each time any ModelRunner zeroes its KV pool (the workers'
    start-up rehearsal tests: once per start-up)."""
    from splitserve.engine.model_runner import ModelRunner

    calls: list[int] = []
    real = ModelRunner.zero_kv
    monkeypatch.setattr(ModelRunner, "zero_kv", lambda self: calls.append(1) or real(self))
    return calls
