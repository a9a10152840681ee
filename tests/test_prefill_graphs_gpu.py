"""Piecewise prefill graphs on the GPU (engine/prefill_graphs.py): 20 random packed batches
(mixed lengths, chunks after a computed prefix) replayed from the bucket graphs give the eager
step's logits within bf16 tolerance, the same first tokens and the same KV; a step above the
largest bucket runs eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.config.engine_config import EngineConfig
from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.prefill_graphs import capture_prefill_graphs

pytestmark = pytest.mark.gpu

BS = 16
SIZES = [16, 32, 64, 128, 256, 512]
TOL = 3e-2  # bf16: cuBLAS picks other tiles at the padded token count


def _runner(model) -> ModelRunner:
    cfg = EngineConfig(
        model_path=str(model),
        device="cuda",
        dtype="bfloat16",
        cache={"num_blocks": 512, "block_size": BS},
        scheduler={"max_model_len": 1024, "max_num_batched_tokens": 512},
    )
    return ModelRunner(cfg)


@pytest.fixture(scope="module")
def pair(tiny_llama):
    eager, graphed = _runner(tiny_llama), _runner(tiny_llama)
    assert capture_prefill_graphs(graphed, SIZES, 512) is not None
    graphed.kv_cache.zero_()
    yield eager, graphed
    graphed.prefill_graphs.release()


def _batch(rng) -> list[PrefillChunk]:
    chunks, next_block, budget = [], 1, 512
    for _ in range(rng.randint(1, 6)):
        computed = rng.choice([0, 0, rng.randrange(0, 200)])
        n = rng.randint(1, min(200, budget - 5)) if budget > 6 else 1
        budget -= n
        k = -(-(computed + n) // BS)
        table = list(range(next_block, next_block + k))
        next_block += k
        chunks.append(PrefillChunk([rng.randrange(3, 500) for _ in range(n)], computed, table))
        if budget <= 1:
            break
    return chunks


def test_graph_replays_match_the_eager_step_on_20_random_packed_batches(pair):
    eager, graphed = pair
    rng = random.Random(20)
    decisive = rows = 0
    for _ in range(20):
        chunks = _batch(rng)
        replays = graphed.prefill_graphs.num_replays
        want, got = eager.prefill(chunks), graphed.prefill(chunks)
        assert graphed.prefill_graphs.num_replays == replays + 1
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
        top2 = want.topk(2, dim=-1).values
        for i in range(want.shape[0]):  # identical unless the eager top two tie at bf16 precision
            rows += 1
            margin = float(top2[i, 0] - top2[i, 1])
            if margin > float(want[i].abs().max()) * 2**-7:
                decisive += 1
                assert int(got[i].argmax()) == int(want[i].argmax()), (margin, chunks)
        # a chunk's prefix blocks hold what each runner wrote earlier: compare only new tokens
        for c in chunks:
            flat = lambda r, t=c.block_table: r.kv_cache[:, :, t].flatten(2, 3)  # noqa: E731
            end = c.num_computed + len(c.token_ids)
            torch.testing.assert_close(
                flat(graphed)[:, :, c.num_computed : end].float(),
                flat(eager)[:, :, c.num_computed : end].float(),
                atol=TOL,
                rtol=TOL,
            )
    # random bf16 weights leave many rows near a tie; the argmax check must still bite
    assert decisive > 0, (decisive, rows)


def test_a_step_above_the_largest_bucket_runs_eagerly(pair):
    eager, graphed = pair
    chunks = [PrefillChunk([3 + i % 500 for i in range(600)], 0, list(range(1, 1 + -(-600 // BS))))]
    replays = graphed.prefill_graphs.num_replays
    torch.testing.assert_close(graphed.prefill(chunks), eager.prefill(chunks))
    assert graphed.prefill_graphs.num_replays == replays
