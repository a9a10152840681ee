"""Checkpoints with a vocab that 2 ranks cannot split evenly (509 rows: rank 0 holds 255, rank 1
holds 254 and one zero padding row), untied (`tiny`) and tied (`tiny-qwen2`)."""

from __future__ import annotations

import pytest

ODD_VOCAB = 509  # the tokenizer keeps 512 ids; tests feed and sample ids < 509 only


def _odd(preset: str, tmp_path_factory):
    from splitserve.cli.make_model import make_model
    from splitserve.cli.presets import PRESETS

    name = f"{preset}-odd-vocab"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, name, {**PRESETS[preset], "vocab_size": ODD_VOCAB})
        return make_model(name, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="session")
def tiny_llama_odd_vocab(tmp_path_factory):
    return _odd("tiny", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwen2_odd_vocab(tmp_path_factory):
    return _odd("tiny-qwen2", tmp_path_factory)
