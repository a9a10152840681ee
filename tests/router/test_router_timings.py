"""The second token's gap split by the router over real workers, for both hand-overs: the pull
after the prefill lies wholly in the gap (handover holds at least the decode worker's pull),
a streamed one mostly overlaps the prefill (handover holds at most it); the parts add up to no
more than the gap, and each part is observed once per request in the component histogram.
Every test ends with all KV blocks free."""

from __future__ import annotations

import asyncio

import pytest
from router_helpers import generate, greedy, ids_request, router_config, running_router

PROMPTS = [[1] + list(range(300, 340)), [1, 44, 45, 46, 200, 201, 202], list(range(2, 90))]
GAP_PARTS = ("handover_ms", "first_decode_step_ms", "second_token_delivery_ms")
TOL_MS = 0.01  # float32 on the wire


@pytest.mark.parametrize("streaming", [False, True], ids=["pull", "streamed"])
def test_handover_is_the_part_of_the_gap_the_prefill_did_not_hide(cluster, streaming):
    async def body():
        cfg = router_config(
            cluster.model, [cluster.prefill], [cluster.decode], routing={"kv_streaming": streaming}
        )
        async with running_router(cfg) as (r, stub):
            results = []
            for i, prompt in enumerate(PROMPTS * 2):  # one at a time
                results.append(
                    await generate(stub, ids_request(prompt, greedy(4), request_id=f"t{i}"))
                )
            await cluster.assert_free()
        reg = r.metrics.registry
        counts = {
            c: reg.get_sample_value(
                "splitserve_router_ttft_component_seconds_count", {"component": c}
            )
            for c in ("router_queue", "first_token_delivery", "handover", "first_decode_step")
        }
        return results, counts

    results, counts = asyncio.run(body())
    for res in results:
        last = res.last
        assert last.kv_handover.streamed == streaming and not last.kv_handover.recomputed, last
        t = last.timings
        assert t.HasField("second_token_gap_ms") and t.first_decode_step_ms > 0, t
        assert sum(getattr(t, k) for k in GAP_PARTS) <= t.second_token_gap_ms + TOL_MS, t
        transfer = last.kv_handover.transfer_ms
        if streaming:  # the stream ran alongside the prefill: only its tail is in the gap
            assert t.handover_ms <= transfer + TOL_MS, (t, transfer)
        else:  # the pull starts after the first token went out
            assert t.handover_ms >= transfer - TOL_MS, (t, transfer)
    assert counts == dict.fromkeys(counts, float(len(results))), counts
