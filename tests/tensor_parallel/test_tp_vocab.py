"""Vocab-parallel embedding and lm_head, the parts that need no second process: each rank reads and
holds only its vocab rows (tied or not, padded when the vocab does not divide), and TP 1 keeps the
whole vocab with no collective and no padding. TP2 == TP1 end to end: test_tp_engine.py."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from splitserve.config.engine_config import EngineConfig
from splitserve.config.hf_config import load_model_config
from splitserve.engine import parallel, weights
from splitserve.engine.model import CausalLM
from splitserve.engine.model_runner import DecodeLane, ModelRunner, PrefillChunk
from splitserve.engine.parallel import TPGroup

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


class _Recording:
    """A safe_open handle that records which tensors were read whole."""

    def __init__(self, handle, whole: set[str]) -> None:
        self._handle, self._whole = handle, whole

    def __enter__(self):
        self._handle = self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def get_tensor(self, name):
        self._whole.add(name)
        return self._handle.get_tensor(name)

    def __getattr__(self, name):
        return getattr(self._handle, name)


@pytest.mark.parametrize(
    "checkpoint", ["tiny_llama", "tiny_qwen2", "tiny_llama_odd_vocab", "tiny_qwen2_odd_vocab"]
)
def test_each_rank_reads_and_holds_only_its_vocab_rows(checkpoint, request, monkeypatch):
    folder = request.getfixturevalue(checkpoint)
    cfg = load_model_config(folder)
    vocab, h, tied = cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        full = {n: f.get_tensor(n) for n in VOCAB_TENSORS if n in f.keys()}  # noqa: SIM118 - safe_open has no __contains__
    whole: set[str] = set()
    monkeypatch.setattr(weights, "safe_open", lambda *a, **k: _Recording(safe_open(*a, **k), whole))
    rows = -(-vocab // 2)  # 256 of 512; 255 of 509 (rank 1: 254 real + 1 padding row)
    for rank in range(2):
        model = CausalLM(cfg, torch.float32, "cpu", TPGroup(rank, 2))
        weights.load_weights(model, folder)
        assert not whole & set(
            VOCAB_TENSORS
        )  # sliced reads only (get_slice), never the whole tensor
        assert model.vocab_start == rank * rows
        assert model.embed.shape == model.lm_head.shape == (rows, h)
        assert (
            model.lm_head is model.embed
        ) == tied  # tied: the lm_head slice is the embedding slice
        held = {p.data_ptr(): p.numel() for p in (model.embed, model.lm_head)}
        assert sum(held.values()) == rows * h * (
            1 if tied else 2
        )  # about half of TP1's vocab bytes
        real = min(vocab - rank * rows, rows)
        torch.testing.assert_close(
            model.embed[:real], full[VOCAB_TENSORS[0]][rank * rows : rank * rows + real]
        )
        if not tied:
            torch.testing.assert_close(
                model.lm_head[:real], full[VOCAB_TENSORS[1]][rank * rows : rank * rows + real]
            )
        assert (
            not model.embed[real:].any() and not model.lm_head[real:].any()
        )  # padding rows are zero
        assert real == rows or (vocab % 2 and rank == 1)


def test_tp1_keeps_the_whole_vocab_with_no_collective(tiny_llama_odd_vocab, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a collective ran at tensor_parallel_size 1")

    for name in ("all_reduce", "all_gather_into_tensor", "broadcast"):
        monkeypatch.setattr(torch.distributed, name, refuse)
    monkeypatch.setattr(parallel, "_all_gather_single", refuse)
    runner = ModelRunner(
        EngineConfig(
            model_path=str(tiny_llama_odd_vocab),
            device="cpu",
            cache={"num_blocks": 16, "block_size": 8},
        )
    )
    vocab = runner.model_config.vocab_size
    assert runner.model.embed.shape == (vocab, 64) and runner.model.vocab_start == 0
    logits = runner.prefill([PrefillChunk([1, 0, 254, 508], 0, [1])])
    assert logits.shape == (1, vocab) and logits.dtype == torch.float32 and logits.is_contiguous()
    step = runner.decode([DecodeLane(int(logits.argmax()), 4, [1])])
    assert step.shape == (1, vocab) and step.is_contiguous()
