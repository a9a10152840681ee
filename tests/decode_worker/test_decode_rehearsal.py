"""The decode worker's start-up rehearsal (decode_worker/rehearsal.py): colocated requests per
local-prefill token bucket through the engine before SERVING, leaving no trace (no metric, no
block held, the pool zeroed) and no effect on what users get."""

from __future__ import annotations

import asyncio
import random

import pytest
from decode_helpers import assert_all_free, collect_stream, serving

from splitserve.decode_worker.config import DecodeFaults
from splitserve.kvtransfer.config import REHEARSAL_ID
from splitserve.protos import generate_pb2, worker_pb2
from splitserve.request.sampling_params import SamplingParams


def _value(worker, name: str, **labels) -> float:
    return worker.metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_rehearsal_leaves_no_trace_and_users_get_isolated_tokens(tiny_llama, oracle):
    rng = random.Random(5)
    prompt = [1] + [rng.randrange(3, 500) for _ in range(20)]
    sp = dict(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        # max_model_len 256, prefill_chunk_tokens 512, pool 127 blocks of 4: the largest is 254
        async with serving(tiny_llama, rehearsal=True) as (worker, stub, _):
            assert worker.rehearsal_sizes == [254, 128, 64, 32, 16]
            engine = worker.engine
            assert worker.loop.progress >= len(worker.rehearsal_sizes)  # its steps ran
            assert float(engine.runner.kv_cache.abs().sum()) == 0.0  # zeroed after it
            assert_all_free(engine)
            for name in (
                "splitserve_decode_step_seconds_count",
                "splitserve_decode_prompt_tokens_total",
            ):
                assert _value(worker, name) == 0, name
            assert _value(worker, "splitserve_decode_requests_finished_total", reason="length") == 0
            req = worker_pb2.DecodeRequest(
                request_id="u", prompt_token_ids=prompt, sampling=generate_pb2.SamplingParams(**sp)
            )
            tokens, _ = await collect_stream(stub.Decode(req))
            assert tokens == oracle(prompt, SamplingParams(**sp)).token_ids
            assert _value(worker, "splitserve_decode_prompt_tokens_total") == len(prompt)
            # the stream's end reaches the client before the step that frees it is over
            await asyncio.wrap_future(worker.loop.call(lambda: None))
            assert_all_free(engine)

    asyncio.run(main())


def test_rehearsal_is_off_by_default_on_cpu_and_sized_by_the_chunk_and_pool(tiny_llama):
    async def main():
        async with serving(tiny_llama) as (worker, _stub, _):
            cuda = worker.engine.runner.device.type == "cuda"
            assert (worker.rehearsal_sizes != []) == cuda  # default: CUDA only
        async with serving(tiny_llama, rehearsal=True, prefill_chunk_tokens=40) as (worker, _s, _):
            assert worker.rehearsal_sizes == [40, 32, 16]
            assert_all_free(worker.engine)
        # one-token blocks, a pool smaller than the chunk: the prompt and its two tokens fit
        kw = dict(rehearsal=True, block_size=1, num_blocks=64)
        async with serving(tiny_llama, **kw) as (worker, _s, _):
            assert worker.rehearsal_sizes == [61, 32, 16]  # 63 usable blocks - 2
            assert_all_free(worker.engine)

    asyncio.run(main())


def test_the_pool_is_zeroed_once_per_start_up(tiny_llama, zero_kv_calls):
    """Once, after the rehearsal (tensor-parallel followers freeze their heap on it)."""
    calls = zero_kv_calls

    async def main():
        for rehearsal in (True, False):
            calls.clear()
            async with serving(tiny_llama, rehearsal=rehearsal) as (worker, _s, _):
                assert len(calls) == 1, rehearsal
                assert float(worker.engine.runner.kv_cache.abs().sum()) == 0.0

    asyncio.run(main())


def test_a_failed_rehearsal_fails_the_start_and_restores_the_metrics(tiny_llama, monkeypatch):
    from decode_helpers import worker_config

    from splitserve.decode_worker.engine import DecodeEngine
    from splitserve.decode_worker.worker import DecodeWorker
    from splitserve.request.errors import RequestError

    def refuse(self, inp, sink):
        raise RequestError.invalid("refused on purpose")

    monkeypatch.setattr(DecodeEngine, "submit", refuse)

    async def main():
        worker = DecodeWorker(worker_config(tiny_llama, rehearsal=True))
        with pytest.raises(RuntimeError, match="rehearsal failed: .*refused on purpose"):
            await worker.start()
        assert worker.engine.metrics is worker.metrics
        await worker.stop(grace_s=1.0)
        assert not worker.loop.alive
        assert_all_free(worker.engine)

    asyncio.run(main())


def test_test_faults_never_hit_the_rehearsal():
    faults = DecodeFaults(step_delay_s=5.0, delay_before_pull_s=1.0)  # every request id
    assert faults.step_delay(["u"]) == 5.0 and faults.pull_delay("u") == 1.0
    assert faults.step_delay([REHEARSAL_ID]) == 0.0 and faults.pull_delay(REHEARSAL_ID) == 0.0
