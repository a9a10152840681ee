"""Workers (and a router) that die, hang or never collect: each case starts the processes it
kills next to the shared ones, and ends with the suite's uniform checks on the survivors."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from fault_helpers import (
    SLOW_PULL,
    Ledger,
    finish_case,
    leases_held,
    metric,
    start_on,
    start_worker,
    wait_all_healthy,
    wait_no_lease,
)
from router_helpers import greedy, router_config, running_router, wait_until

from splitserve.protos import generate_pb2_grpc
from splitserve.request.sampling_params import SamplingParams

PROMPT = [1, 44, 45, 46, 200, 201, 202]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
pytestmark = (
    pytest.mark.slow
)  # the suite's slowest file: processes killed, restarted and waited out


def _want(oracle, n: int, prompt=PROMPT) -> list[int]:
    return oracle(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)).token_ids


def test_lease_nobody_collects_expires_and_frees(cluster, oracle, procs):
    """The router dies while the decode worker holds the request before its pull: nobody pulls
    and nobody releases; the lease's TTL frees the blocks and counts an expiry. (While the router
    lives, a decode worker that died or refused has its lease released by the router at once:
    test_decode_refused_before_its_first_chunk_is_retried_elsewhere; TTL is the backstop for when
    no one is left to release it.)"""
    ttl_s = 1.0
    prefill, pm = start_worker(procs, "prefill", cluster.model, None, "--lease-ttl-s", str(ttl_s))
    router = procs.router(
        cluster.model,
        "--prefill",
        prefill.address,
        "--decode",
        cluster.decode,
        "--max-model-len",
        "256",
        "--poll-interval-s",
        "0.2",
    )

    async def body():
        ledger = Ledger(f"{SLOW_PULL}-orphan")  # the decode worker waits before pulling
        async with grpc.aio.insecure_channel(router.address) as channel:
            t = ledger.start(generate_pb2_grpc.GenerateServiceStub(channel), PROMPT)
            await t.read(1)
            assert await leases_held(prefill.address) == 1
            router.kill()
            assert await t.finish() == UNAVAILABLE
        await wait_no_lease(prefill.address, ttl_s + 5)  # expired
        expired = metric(pm, "splitserve_kv_lease_expired_total")
        async with running_router(
            router_config(cluster.model, [prefill.address], [cluster.decode])
        ) as (_, stub):
            await finish_case(
                ledger, stub, oracle, [prefill.address], [cluster.decode]
            )  # its router is gone
        return expired

    assert asyncio.run(body()) == 1


STALLS = {
    "before_payload": {"stall_before_payload_s": 60},
    # small messages; the first one lands in the decode side's staging buffer, then the stall
    "mid_payload": {"message_bytes": 512, "stall_after_first_message_s": 60},
}


@pytest.mark.parametrize(
    ("policy", "phase"),
    [("recompute", "before_payload"), ("fail", "before_payload"), ("recompute", "mid_payload")],
)
def test_prefill_killed_mid_transfer(cluster, oracle, procs, policy, phase):
    """The prefill worker dies after its pull reply, before the payload or with part of it sent
    (a stall holds it there): the decode worker fails the pull within its data timeout, then
    recomputes (same tokens) or ends UNAVAILABLE; the blocks it reserved go back unused (a
    partial payload stays in the staging buffer, never unpacked into blocks), and the next
    requests on the same decode worker are the oracle's."""
    data_timeout_s = 5.0
    doomed, doomed_metrics = start_worker(
        procs, "prefill", cluster.model, {"transfer": STALLS[phase]}, wait=False
    )
    decode, dm = start_worker(
        procs,
        "decode",
        cluster.model,
        None,
        "--kv-failure-policy",
        policy,
        "--kv-data-timeout-s",
        str(data_timeout_s),
        wait=False,
    )
    doomed.wait_serving()
    decode.wait_serving()

    async def body():
        ledger = Ledger(f"midpull-{policy}-{phase}")
        async with running_router(
            router_config(  # the pull after the prefill: it is killed in its payload
                cluster.model, [doomed.address], [decode.address], routing={"kv_streaming": False}
            )
        ) as (r, stub):
            t = ledger.start(stub, PROMPT, greedy(12, ignore_eos=True))
            await t.read(1)
            # the pull is asked for and answered; the payload (or its rest) is stalled
            await wait_until(
                lambda: metric(doomed_metrics, "splitserve_kv_transfer_sending") == 1,
                20,
                "the pull answered, its payload stalled",
            )
            await asyncio.sleep(0.3)  # mid_payload: the first message reaches the decode side
            doomed.kill()
            killed_at = time.monotonic()
            await t.finish()
            failed_s = time.monotonic() - killed_at
            failures = sum(
                metric(dm, "splitserve_kv_transfer_failures_total", reason=why)
                for why in ("peer_failed", "data_timeout")
            )
            async with running_router(
                router_config(cluster.model, [cluster.prefill], [decode.address])
            ) as (_, s2):
                await finish_case(ledger, s2, oracle, [cluster.prefill], [decode.address], r)
        return t, failed_s, failures

    t, failed_s, failures = asyncio.run(body())
    assert failures == 1 and failed_s < data_timeout_s + 2, (t.status, t.details, failed_s)
    if policy == "recompute":
        assert t.status == "OK/LENGTH" and t.tokens == _want(oracle, 12)
    else:
        assert (
            t.code == UNAVAILABLE
            and "KV transfer failed" in t.details
            and t.tokens == _want(oracle, 1)
        )


def _two_decode_router(cluster, extra: str, **registry):
    return running_router(
        router_config(
            cluster.model,
            [cluster.prefill],
            [extra, cluster.decode],
            routing={"decode_policy": "round_robin"},
            registry=registry,
        )
    )


def test_decode_killed_mid_stream_is_unavailable_and_evicted(cluster, oracle, procs):
    doomed, _ = start_worker(procs, "decode", cluster.model)

    async def body():
        ledger = Ledger("decodekill")
        async with _two_decode_router(cluster, doomed.address) as (r, stub):
            await wait_all_healthy(r)
            t = await start_on(ledger, stub, doomed.address, [cluster.decode], PROMPT)
            await t.read(2)
            doomed.kill()
            assert await t.finish() == UNAVAILABLE
            evicted = not r.registry.get(doomed.address).healthy
            after = [await ledger.run(stub, PROMPT, greedy(8, ignore_eos=True)) for _ in range(3)]
            await finish_case(ledger, stub, oracle, [cluster.prefill], [cluster.decode], r)
            return t, evicted, after, r.metrics.evictions("decode")

    t, evicted, after, evictions = asyncio.run(body())
    assert f"failed after {len(t.tokens)} tokens were streamed" in t.details
    assert (
        2 <= len(t.tokens) < 249 and t.tokens == _want(oracle, 249)[: len(t.tokens)]
    )  # never a replay
    # at once, not after several probes: the stream's UNAVAILABLE or the refused probe
    assert (
        evicted
        and sum(evictions.values()) == 1
        and set(evictions) <= {"request_unavailable", "refused"}
    )
    assert all(a.status == "OK/LENGTH" and a.tokens == _want(oracle, 8) for a in after)


def test_decode_refused_before_its_first_chunk_is_retried_elsewhere(cluster, oracle, procs):
    """A decode worker gone while the router still believes in it (probes far apart): the
    request it gets is refused before any decode chunk, and goes to the other worker."""
    gone, _ = start_worker(procs, "decode", cluster.model)

    async def body():
        ledger = Ledger("refused")
        async with _two_decode_router(cluster, gone.address, poll_interval_s=60) as (r, stub):
            await wait_all_healthy(r)
            gone.kill()
            done = [
                await ledger.run(stub, PROMPT, greedy(8, ignore_eos=True)) for _ in range(2)
            ]  # round robin
            evictions = r.metrics.evictions("decode")
            await finish_case(ledger, stub, oracle, [cluster.prefill], [cluster.decode], r)
            return done, evictions

    done, evictions = asyncio.run(body())
    assert all(t.status == "OK/LENGTH" and t.tokens == _want(oracle, 8) for t in done)
    assert evictions == {"request_unavailable": 1}  # the refusal itself, probes being 60 s apart


PROBE_TIMEOUT_S, POLL_S, SLOW_PROBES = 1.0, 0.2, 3
# a wedged worker is only slow as far as the router can tell: it goes after SLOW_PROBES timed-out
# probes in a row (registry.probe_failures_to_evict), each a timeout and an interval, plus slack
EVICT_BOUND_S = SLOW_PROBES * (PROBE_TIMEOUT_S + POLL_S) + 2.0


def test_wedged_decode_worker_is_evicted_in_bounded_time_and_recovers(cluster, oracle, procs):
    wedged, _ = start_worker(procs, "decode", cluster.model)

    async def body():
        ledger = Ledger("wedged")
        async with _two_decode_router(
            cluster, wedged.address, probe_timeout_s=PROBE_TIMEOUT_S, poll_interval_s=POLL_S
        ) as (r, stub):
            await wait_all_healthy(r)
            t = await start_on(ledger, stub, wedged.address, [cluster.decode], PROMPT)
            await t.read(2)
            os.kill(wedged.proc.pid, signal.SIGSTOP)
            try:
                stopped_at = time.monotonic()
                w = r.registry.get(wedged.address)
                await wait_until(lambda: not w.healthy, EVICT_BOUND_S + 5, "wedged worker evicted")
                evicted_s, why = time.monotonic() - stopped_at, w.why
                during = [
                    await ledger.run(stub, PROMPT, greedy(8, ignore_eos=True)) for _ in range(2)
                ]
                t.call.cancel()  # its client gives up on the wedged stream
                assert await t.finish() == grpc.StatusCode.CANCELLED
            finally:
                os.kill(wedged.proc.pid, signal.SIGCONT)
            await wait_until(
                lambda: w.healthy, EVICT_BOUND_S + 5, "recovered worker back in rotation"
            )
            await finish_case(
                ledger, stub, oracle, [cluster.prefill], [wedged.address, cluster.decode], r, n=2
            )
            return evicted_s, why, during

    evicted_s, why, during = asyncio.run(body())
    assert evicted_s <= EVICT_BOUND_S and "DEADLINE_EXCEEDED" in why, (evicted_s, why)
    assert evicted_s >= (SLOW_PROBES - 1) * PROBE_TIMEOUT_S, (
        evicted_s
    )  # not at the first slow probe
    assert all(a.status == "OK/LENGTH" and a.tokens == _want(oracle, 8) for a in during)
