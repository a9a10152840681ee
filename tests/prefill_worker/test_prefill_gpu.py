"""On CUDA the prefill worker's first tokens (chunked, with prefix-cache hits) equal the CPU
eager reference, and the KV it leaves equals the CPU reference's KV."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prefill_helpers import prefill_request, release, serving, worker_config
from test_prefill_first_token import BS, PROMPTS, SHARED

from splitserve.engine.model_runner import ModelRunner, PrefillChunk

pytestmark = pytest.mark.gpu


def _cpu_reference(folder, prompt):
    runner = ModelRunner(worker_config(folder, num_blocks=64, block_size=BS).engine)
    table = list(range(1, 1 + -(-len(prompt) // BS)))
    token = int(runner.prefill([PrefillChunk(prompt, 0, table)])[0].argmax())
    return token, runner.kv_cache[:, :, table].flatten(2, 3)[:, :, : len(prompt)]


@pytest.mark.parametrize("budget", [8192, 7])
def test_cuda_first_token_equals_cpu_reference(tiny_llama, budget):
    cfg = worker_config(tiny_llama, num_blocks=128, block_size=BS, budget=budget)
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"device": "cuda"})})
    prompts = PROMPTS + [SHARED + [5, 6, 7]]  # the last one hits the prefix cache

    async def body():
        async with serving(cfg) as (worker, stub):
            for tag in ("cold", "warm"):
                resps = await asyncio.gather(
                    *(stub.Prefill(prefill_request(f"{tag}{i}", p)) for i, p in enumerate(prompts))
                )
                for prompt, resp in zip(prompts, resps):
                    token, kv = _cpu_reference(str(tiny_llama), prompt)
                    assert resp.first_token_id == token
                    lease = worker.engine.leases.get(resp.kv.lease_id)
                    got = worker.engine.runner.kv_cache[:, :, list(lease.block_ids)].flatten(2, 3)[
                        :, :, : len(prompt)
                    ]
                    torch.testing.assert_close(got.cpu(), kv, atol=1e-4, rtol=1e-4)
                    await release(stub, resp)
            assert resps[-1].cached_prompt_tokens > 0

    asyncio.run(body())
