"""The prefill worker's first token equals transformers' greedy token, and the KV it leaves
in its pool equals a one-shot recompute, with and without chunking and prefix-cache hits."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prefill_helpers import prefill_request, release, serving, worker_config

from splitserve.engine.model_runner import ModelRunner, PrefillChunk
from splitserve.engine.sampler import Sampler, SeqSamplingInfo
from splitserve.protos import generate_pb2
from splitserve.service.proto_convert import sampling_params_from_proto

BS = 4
PROMPTS = [
    [1, 72, 101, 108, 108, 111, 44, 32, 119],
    [1, 200],
    [1] + list(range(300, 337)),
    [1, 7, 9, 11, 13],
    [1] + list(range(40, 110)),
]
SHARED = PROMPTS[4][:41]  # 10 full blocks + 1 token of PROMPTS[4]


@pytest.fixture(scope="module")
def oracle():
    """checkpoint folder -> transformers model (fp32), loaded once per module."""
    transformers = pytest.importorskip("transformers")
    models = {}

    def first_token(folder, prompt):
        if folder not in models:
            models[folder] = transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32
            ).eval()
        with torch.no_grad():
            return int(models[folder](torch.tensor([prompt])).logits[0, -1].argmax())

    return first_token


def _kv(runner: ModelRunner, blocks, n: int) -> torch.Tensor:
    return runner.kv_cache[:, :, list(blocks)].flatten(2, 3)[:, :, :n]


class _Recompute:
    """A fresh runner that prefills each prompt in one shot into its own blocks."""

    def __init__(self, cfg) -> None:
        self.runner = ModelRunner(cfg.engine)

    def kv(self, prompt) -> torch.Tensor:
        table = list(range(1, 1 + -(-len(prompt) // BS)))
        self.runner.prefill([PrefillChunk(prompt, 0, table)])
        return _kv(self.runner, table, len(prompt))


async def _prefill_and_check(
    worker, stub, oracle, folder, recompute, prompts, tag, release_after=True
):
    resps = await asyncio.gather(
        *(stub.Prefill(prefill_request(f"{tag}{i}", p)) for i, p in enumerate(prompts))
    )
    for prompt, resp in zip(prompts, resps):
        assert resp.first_token_id == oracle(folder, prompt)
        assert resp.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED
        assert resp.kv.num_tokens == len(prompt) and resp.kv.num_blocks == -(-len(prompt) // BS)
        assert resp.queue_time_ms >= 0 and resp.compute_time_ms > 0  # the prefill parts of TTFT
        lease = worker.engine.leases.get(resp.kv.lease_id)
        torch.testing.assert_close(
            _kv(worker.engine.runner, lease.block_ids, len(prompt)),
            recompute.kv(prompt),
            atol=1e-5,
            rtol=1e-5,
        )
        if release_after:
            await release(stub, resp)
    return resps


@pytest.mark.parametrize(
    ("checkpoint", "budget"), [("tiny_llama", 8192), ("tiny_llama", 7), ("tiny_qwen2", 5)]
)
def test_first_token_and_kv_match_oracle(checkpoint, budget, oracle, request):
    folder = str(request.getfixturevalue(checkpoint))
    cfg = worker_config(folder, num_blocks=128, block_size=BS, budget=budget)
    recompute = _Recompute(cfg)

    async def body():
        async with serving(cfg) as (worker, stub):
            # cold cache, a batch of mixed lengths (chunked when the budget is small)
            first = await _prefill_and_check(
                worker, stub, oracle, folder, recompute, PROMPTS, "cold"
            )
            assert [r.cached_prompt_tokens for r in first] == [0] * len(PROMPTS)
            steps = worker.metrics.registry.get_sample_value(
                "splitserve_prefill_batch_tokens_count"
            )
            assert steps >= -(-sum(map(len, PROMPTS)) // budget)
            # hits on blocks nobody holds (evictable): a longer prompt on a cached prefix, and a
            # repeat that must still compute its last token
            held = await _prefill_and_check(
                worker,
                stub,
                oracle,
                folder,
                recompute,
                [SHARED + [5, 6, 7, 8, 9], PROMPTS[2]],
                "warm",
                release_after=False,
            )
            assert [r.cached_prompt_tokens for r in held] == [40, 36]
            # hits on blocks a lease still holds (shared, ref-counted)
            again = await _prefill_and_check(
                worker, stub, oracle, folder, recompute, [SHARED + [9, 8], PROMPTS[4]], "shared"
            )
            assert [r.cached_prompt_tokens for r in again] == [40, 68]
            for resp in held:
                await release(stub, resp)
            assert (
                worker.metrics.registry.get_sample_value("splitserve_prefill_cached_token_ratio")
                > 0
            )

    asyncio.run(body())


def test_seeded_sampling_and_logprobs_follow_request_params(tiny_llama):
    cfg = worker_config(tiny_llama)
    prompt = [1, 33, 44, 55, 66, 77]
    sampling = generate_pb2.SamplingParams(
        temperature=0.9, top_p=0.95, seed=1234, logprobs=3, max_tokens=4
    )
    params = sampling_params_from_proto(
        sampling, prompt_len=len(prompt), max_model_len=1024, vocab_size=512
    )
    runner = ModelRunner(cfg.engine)
    logits = runner.prefill([PrefillChunk(prompt, 0, [1, 2])])
    want = Sampler(seed=99).sample(logits, [SeqSamplingInfo(params, prompt, [])])

    async def body():
        async with serving(cfg) as (_worker, stub):
            resp = await stub.Prefill(prefill_request("s", prompt, sampling))
            assert resp.first_token_id == want.token_ids[0]
            lp = resp.first_token_logprob
            assert lp.token_id == want.token_ids[0]
            assert lp.logprob == pytest.approx(want.logprobs[0].logprob, abs=1e-5)
            assert [t.token_id for t in lp.top_logprobs] == [t for t, _ in want.logprobs[0].top]
            await release(stub, resp)

    asyncio.run(body())
