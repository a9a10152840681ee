"""Piecewise prefill graphs on the GPU (engine/prefill_graphs.py): 20 random packed batches
(mixed lengths, chunks after a computed prefix) replayed from the bucket graphs give the eager
step's logits within bf16 tolerance, the same first tokens and the same KV; so do single fresh
prompts through dense (cuDNN) attention; a step above the largest bucket runs eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.config.engine_config import EngineConfig
from splitserve.engine import prefill_dense
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


DENSE_MIN = 256  # (the default, 2048, is above these graphs: dense from the 256 bucket here)


@pytest.fixture(scope="module")
def pair(tiny_llama):
    eager, graphed = _runner(tiny_llama), _runner(tiny_llama)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefill_dense, "DENSE_MIN_TOKENS", DENSE_MIN)
        assert capture_prefill_graphs(graphed, SIZES, 512) is not None
        graphed.prefill_graphs.prepare_dense_here()  # (this thread runs the steps)
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


def _same_step(eager, graphed, chunks) -> int:
    """Asserts the graphed step matches the eager one; returns its decisive rows (top-two
    margin above bf16 precision: the argmax must agree there)."""
    want, got = eager.prefill(chunks), graphed.prefill(chunks)
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    top2, decisive = want.topk(2, dim=-1).values, 0
    for i in range(want.shape[0]):  # identical unless the eager top two tie at bf16 precision
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
    return decisive


def test_graph_replays_match_the_eager_step_on_20_random_packed_batches(pair):
    eager, graphed = pair
    rng = random.Random(20)
    decisive = 0
    for _ in range(20):
        chunks = _batch(rng)
        replays = graphed.prefill_graphs.num_replays
        decisive += _same_step(eager, graphed, chunks)
        assert graphed.prefill_graphs.num_replays == replays + 1
    # random bf16 weights leave many rows near a tie; the argmax check must still bite
    assert decisive > 0


def test_fresh_single_prompts_run_dense_attention_like_the_eager_step(pair):
    """kernels/dense_attention.py (cuDNN) from the DENSE_MIN bucket up (the fused pieces give
    way there), its plans built at capture; a prompt after a cached prefix keeps the varlen
    kernel."""
    eager, graphed = pair
    graphs = graphed.prefill_graphs
    assert graphs.dense and DENSE_MIN in SIZES
    rng, decisive = random.Random(7), 0
    for n in (DENSE_MIN // 2 + 1, 200, 300, 411, 511, 512):
        before = graphs.num_dense
        prompt = [rng.randrange(3, 500) for _ in range(n)]
        decisive += _same_step(eager, graphed, [PrefillChunk(prompt, 0, list(range(1, 34)))])
        assert graphs.num_dense == before + 1
    before = graphs.num_dense
    prompt = [rng.randrange(3, 500) for _ in range(300)]
    decisive += _same_step(eager, graphed, [PrefillChunk(prompt, 200, list(range(1, 34)))])
    assert graphs.num_dense == before and decisive > 0


def test_a_step_above_the_largest_bucket_runs_eagerly(pair):
    eager, graphed = pair
    chunks = [PrefillChunk([3 + i % 500 for i in range(600)], 0, list(range(1, 1 + -(-600 // BS))))]
    replays = graphed.prefill_graphs.num_replays
    torch.testing.assert_close(graphed.prefill(chunks), eager.prefill(chunks))
    assert graphed.prefill_graphs.num_replays == replays
