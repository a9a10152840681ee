"""A KV payload corrupted, truncated (fewer bytes than announced) or announced with the wrong
length (the prefill listener's test-only transfer faults, for ids with a prefix) is caught by the
decode side's checksum or length check and discarded: the request is recomputed (the shared
decode worker's policy) and its tokens are the oracle's, never garbage; an unaffected request
through the same workers is pulled as usual."""

from __future__ import annotations

import asyncio

import pytest
from fault_helpers import Ledger, finish_case, metric, start_worker
from router_helpers import greedy, router_config, running_router

from splitserve.request.sampling_params import SamplingParams

FAULTS = (  # each case 30 tokens: 8 blocks
    "corrupt_payload",
    "truncate_payload",
    "misstate_payload_bytes",
)


def _prompt(fault: str) -> list[int]:
    """A prompt of its own per case (same length): a truncated payload received into a staging
    buffer that still held an earlier case's bytes of the same prompt came out whole once."""
    return [1] + list(range(120 + 40 * FAULTS.index(fault), 150 + 40 * FAULTS.index(fault)))


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("corrupt_payload", "checksum"),
        ("truncate_payload", "checksum"),
        ("misstate_payload_bytes", "invalid"),
    ],
)
def test_corrupted_transfer_is_detected_and_never_served(cluster, oracle, procs, fault, reason):
    prefill, _ = start_worker(
        procs, "prefill", cluster.model, {"transfer": {fault: True, "request_id_prefix": "bad"}}
    )
    dm = cluster.decode_metrics

    def counts() -> tuple[float, float]:
        return (
            # any reason: a truncated last message is caught by the checksum, or (seen once
            # on a loaded 2-core machine) fails the receive itself; either way it is discarded
            metric(dm, "splitserve_kv_transfer_failures_total")
            if fault == "truncate_payload"
            else metric(dm, "splitserve_kv_transfer_failures_total", reason=reason),
            metric(dm, "splitserve_kv_transfer_bytes_total", direction="received"),
        )

    async def body():
        ledger = Ledger(f"bad-{fault}")
        async with running_router(
            router_config(  # the pull's payload faults (streams: test_stream_handover.py)
                cluster.model, [prefill.address], [cluster.decode], routing={"kv_streaming": False}
            )
        ) as (r, stub):
            before = counts()
            bad = await ledger.run(stub, _prompt(fault), greedy(10, ignore_eos=True))
            after_bad = counts()
            good = await ledger.run(
                stub, _prompt(fault)[:-1], greedy(10, ignore_eos=True), request_id="clean-pull"
            )
            after_good = counts()
            await finish_case(ledger, stub, oracle, [prefill.address], [cluster.decode], r)
            released = {
                why: r.metrics.leases_released.labels(why)._value.get()
                for why in ("kv_recomputed", "decode_started")
            }
            return bad, good, before, after_bad, after_good, released

    bad, good, before, after_bad, after_good, released = asyncio.run(body())
    # the client sees the recompute, and why, on its last chunk; the clean pull says pulled
    handover = bad.chunks[-1].kv_handover
    assert bad.chunks[-1].HasField("kv_handover") and handover.recomputed, bad.chunks[-1]
    assert handover.reason == reason or (fault == "truncate_payload" and handover.reason)
    assert not good.chunks[-1].kv_handover.recomputed and good.chunks[-1].kv_handover.transfer_ms
    for t, prompt in ((bad, _prompt(fault)), (good, _prompt(fault)[:-1])):
        want = oracle(
            prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        ).token_ids
        assert t.status == "OK/LENGTH" and t.tokens == want
    assert after_bad[0] == before[0] + 1  # detected by checksum or length: discarded
    # the recomputed request's lease was never consumed: the router released it on the decode
    # worker's kv_recomputed; every pulled lease went with its pull (no second ReleaseLease)
    assert released == {"kv_recomputed": 1, "decode_started": 0}, released
    assert (
        after_good[0] == after_bad[0] and after_good[1] > after_bad[1]
    )  # the clean one was pulled
