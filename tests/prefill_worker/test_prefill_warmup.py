"""Warm-up of every prefill shape (engine/prefill_warmup.py) and the kernel-compilation counter.

On CPU no Triton kernel compiles, so what is checked here is the logic the GPU relies on: the
warm-up batches meet every specialisation class a served step can meet (random batches under
the scheduler's limits, and the steps a real engine serves), the counter's hook counts, the
metric is exported, and warm-up leaves the pool zeroed and every block free. The GPU test
(test_prefill_warmup_gpu.py) checks that the counter stays 0 while serving."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from prefill_helpers import (
    GREEDY,
    prefill_request,
    release,
    serving,
    worker_config,
)

from splitserve.engine.prefill_warmup import (
    WarmSeq,
    covered,
    spec_keys,
    token_buckets,
    warmup_batches,
)
from splitserve.kernels import compile_counter
from splitserve.prefill_worker.config import PrefillWorkerConfig

LIMITS = [  # block_size, max_model_len, max_num_batched_tokens, max_batch_size
    (16, 8192, 8192, 256),
    (4, 64, 16, 8),
    (16, 20, 8192, 3),
    (4, 512, 37, 1),
    (8, 8, 8, 4),
]


def _random_batch(rng, bs, max_len, budget, max_seqs) -> list[WarmSeq]:
    """A step the prefill scheduler could form: chunks of prompts after cached prefixes."""
    out, left = [], budget
    for _ in range(rng.randint(1, max_seqs)):
        if left == 0:
            break
        computed = rng.randint(0, max_len - 1)
        tokens = rng.randint(1, min(left, max_len - computed))
        left -= tokens
        width = rng.randint(-(-(computed + tokens) // bs), -(-max_len // bs))  # a longer prompt
        out.append(WarmSeq(tokens, computed, width))
    return out


@pytest.mark.parametrize("limits", LIMITS)
def test_warmup_batches_fit_the_limits_and_cover_every_reachable_class(limits):
    bs, max_len, budget, max_seqs = limits
    max_blocks = -(-max_len // bs)
    batches = warmup_batches(bs, max_blocks, budget, max_seqs, max_len, buckets=True)
    for batch in batches:
        assert 1 <= len(batch) <= max_seqs and sum(s.tokens for s in batch) <= budget
        for s in batch:
            assert s.tokens >= 1 and s.computed + s.tokens <= max_len
            assert s.computed + s.tokens <= s.width * bs and s.width <= max_blocks
    warmed = covered(batches)
    rng = random.Random(7)
    for _ in range(3000):
        batch = _random_batch(rng, bs, max_len, budget, max_seqs)
        assert spec_keys(batch) <= warmed, (batch, spec_keys(batch) - warmed)
    totals = {sum(s.tokens for s in b) for b in batches}
    assert {t for t in token_buckets(min(budget, max_seqs * max_len))} <= totals


def test_token_buckets_are_powers_of_two_up_to_the_budget():
    assert token_buckets(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]


def test_the_counting_hook_counts_and_keeps_a_hook_installed_before_it(caplog):
    triton = pytest.importorskip("triton")
    runtime = triton.knobs.runtime
    assert compile_counter.install() == "knobs.runtime.jit_post_compile_hook"
    assert compile_counter.install() == "knobs.runtime.jit_post_compile_hook"  # once only
    before, per_kernel = compile_counter.compilations(), compile_counter.by_kernel()

    class Info:
        name = "my_kernel"

    runtime.jit_post_compile_hook(key=(), fn=Info())
    assert compile_counter.compilations() == before + 1
    assert compile_counter.by_kernel()["my_kernel"] == per_kernel.get("my_kernel", 0) + 1
    seen = []  # a hook someone installed first still runs, and its answer is kept
    chained = compile_counter._counted(lambda **kw: seen.append(kw["key"]) or "theirs")
    assert chained(key=(7,), fn=Info()) == "theirs" and seen == [(7,)]
    assert compile_counter.compilations() == before + 2
    compile_counter.mark_serving()  # a compilation while serving is also a warning
    runtime.jit_post_compile_hook(key=(), fn=Info())
    assert "compiled kernel my_kernel while serving" in caplog.text
    compile_counter.mark_serving(False)


def _served(runner) -> list[list[WarmSeq]]:
    """Records every prefill step `runner` runs (and runs it)."""
    steps, real = [], runner.prefill

    def prefill(chunks):
        steps.append(
            [WarmSeq(len(c.token_ids), c.num_computed, len(c.block_table)) for c in chunks]
        )
        return real(chunks)

    runner.prefill = prefill
    return steps


def test_served_steps_stay_in_warmed_classes_and_the_counter_is_exported(tiny_llama, monkeypatch):
    import gc

    monkeypatch.delenv("SPLITSERVE_NO_GC_FREEZE", raising=False)
    gc.unfreeze()

    async def run():
        data = worker_config(
            tiny_llama, num_blocks=128, block_size=4, budget=24, max_queue_len=64
        ).model_dump()
        data["engine"]["scheduler"]["max_batch_size"] = 6
        cfg = PrefillWorkerConfig.model_validate({**data, "warmup": True})
        rng = random.Random(3)
        async with serving(cfg) as (worker, stub):
            runner = worker.engine.runner
            assert float(runner.kv_cache.abs().sum()) == 0.0  # warm-up's writes were zeroed
            warmed = covered(
                warmup_batches(
                    runner.block_size, runner.max_blocks_per_seq, 24, 6, runner.max_model_len, False
                )
            )
            steps = _served(runner)
            shared = [rng.randrange(1, 200) for _ in range(12)]  # prefix-cache hits
            prompts = [
                (shared if rng.random() < 0.4 else [])
                + [rng.randrange(1, 200) for _ in range(rng.randint(1, 50))]
                for _ in range(30)
            ]

            async def one(i: int, prompt: list[int]) -> None:
                await release(stub, await stub.Prefill(prefill_request(f"r{i}", prompt, GREEDY)))

            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            assert any(len(s) > 1 for s in steps) and any(len(p) > 24 for p in prompts)
            for step in steps:
                assert spec_keys(step) <= warmed, step
            reg = worker.metrics.registry
            serving_count = reg.get_sample_value(
                "splitserve_kernel_compilations_total", {"phase": "serving"}
            )
            assert serving_count == worker.kernel_compiles.serving == 0
            assert (
                reg.get_sample_value("splitserve_kernel_compilations_total", {"phase": "startup"})
                is not None
            )
            assert "started in" in worker.describe() and worker.startup_s > 0
            # the start-up heap was frozen before SERVING (worker/gc_pauses.py)
            assert worker.frozen_objects > 1000 and "frozen out of the garbage" in worker.describe()
            assert (
                reg.get_sample_value("splitserve_gc_collections_total", {"generation": "2"})
                is not None
            )
            pauses = worker.gc_pauses
            assert pauses._on_gc in gc.callbacks and gc.get_freeze_count() > 0
        # stopped: the heap is the collector's again and the callback is gone
        assert gc.get_freeze_count() == 0 and pauses._on_gc not in gc.callbacks

    with torch.inference_mode(False):
        asyncio.run(run())
