"""The decode worker's start-up rehearsal (decode_worker/rehearsal.py): colocated requests per
local-prefill token bucket through the engine before SERVING, leaving no trace (no metric, no
block held, the pool zeroed) and no effect on what users get."""

from __future__ import annotations

import asyncio
import random

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
            await asyncio.sleep(0.05)  # the stream's end reaches the client before the free
            assert_all_free(engine)

    asyncio.run(main())


def test_rehearsal_is_off_by_default_on_cpu_and_sized_by_the_chunk(tiny_llama):
    async def main():
        async with serving(tiny_llama) as (worker, _stub, _):
            assert worker.rehearsal_sizes == []
        async with serving(tiny_llama, rehearsal=True, prefill_chunk_tokens=40) as (worker, _s, _):
            assert worker.rehearsal_sizes == [40, 32, 16]
            assert_all_free(worker.engine)

    asyncio.run(main())


def test_test_faults_never_hit_the_rehearsal():
    faults = DecodeFaults(step_delay_s=5.0, delay_before_pull_s=1.0)  # every request id
    assert faults.step_delay(["u"]) == 5.0 and faults.pull_delay("u") == 1.0
    assert faults.step_delay([REHEARSAL_ID]) == 0.0 and faults.pull_delay(REHEARSAL_ID) == 0.0
