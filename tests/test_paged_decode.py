"""Decoding through the paged cache equals full recomputation, for batches whose sequences
span several (scattered) blocks, and chunked prefill equals one-shot prefill."""

from __future__ import annotations

import random

import torch

from splitserve.config.engine_config import EngineConfig
from splitserve.engine.model_runner import DecodeLane, ModelRunner, PrefillChunk


def _runner(folder, blocks=128, block_size=4):
    return ModelRunner(
        EngineConfig(model_path=str(folder), cache={"num_blocks": blocks, "block_size": block_size})
    )


def test_decode_over_scattered_blocks_equals_recompute(tiny_llama):
    runner = _runner(tiny_llama)
    rng = random.Random(1)
    free = list(range(1, 128))
    rng.shuffle(free)  # non-contiguous, out-of-order block tables
    prompts = [[1, 5, 9], [1] + [rng.randrange(3, 500) for _ in range(10)], [1, 42]]
    tables = [[free.pop() for _ in range(8)] for _ in prompts]
    seqs = [list(p) for p in prompts]
    logits = runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(prompts, tables)])
    for _ in range(14):  # crosses several 4-token block boundaries
        for s, tok in zip(seqs, logits.argmax(-1).tolist()):
            s.append(tok)
        logits = runner.decode([DecodeLane(s[-1], len(s) - 1, t) for s, t in zip(seqs, tables)])
        recompute_tables = [[free[i * 8 + j] for j in range(8)] for i in range(len(seqs))]
        full = runner.prefill([PrefillChunk(s, 0, t) for s, t in zip(seqs, recompute_tables)])
        torch.testing.assert_close(logits, full, atol=2e-5, rtol=2e-5)
        assert torch.equal(logits.argmax(-1), full.argmax(-1))


def test_chunked_prefill_equals_one_shot(tiny_qwen2):
    runner = _runner(tiny_qwen2, block_size=8)
    prompt = [1] + list(range(20, 60))
    one_shot = runner.prefill([PrefillChunk(prompt, 0, [1, 2, 3, 4, 5, 6])])
    table = [7, 8, 9, 10, 11, 12]
    runner.prefill([PrefillChunk(prompt[:13], 0, table)])
    runner.prefill([PrefillChunk(prompt[13:29], 13, table)])
    last = runner.prefill([PrefillChunk(prompt[29:], 29, table)])
    torch.testing.assert_close(last, one_shot, atol=2e-5, rtol=2e-5)
    # the KV each path wrote is the same
    kv = runner.kv_cache
    n = len(prompt)
    flat = lambda ids: kv[:, :, ids].flatten(2, 3)[:, :, :n]  # noqa: E731
    torch.testing.assert_close(
        flat([7, 8, 9, 10, 11, 12]), flat([1, 2, 3, 4, 5, 6]), atol=1e-5, rtol=1e-5
    )
