"""A client cancel, an expired deadline and the Abort RPC end the worker calls downstream; shortly
after, every worker's GetLoad shows all KV blocks free and no lease held."""

from __future__ import annotations

import asyncio

import grpc
from router_helpers import (
    greedy,
    ids_request,
    read_rest,
    router_config,
    rpc_error,
    running_router,
    wait_until,
)

from splitserve.protos import generate_pb2

PROMPT = [1, 44, 45, 46, 200, 201, 202]
LONG = greedy(249, ignore_eos=True)  # up to max_model_len: about 1.5 s of decoding on this machine


def _outcome(router, name: str) -> float:
    return router.metrics.requests.labels(name)._value.get()


def test_client_cancel_mid_stream_frees_every_worker(cluster):
    async def body():
        async with running_router(
            router_config(cluster.model, [cluster.prefill], [cluster.decode])
        ) as (r, stub):
            aborted_before = cluster.decode_finished("abort")
            call = stub.Generate(ids_request(PROMPT, LONG, request_id="cancel-me"), timeout=60)
            got = [await call.read() for _ in range(3)]
            call.cancel()
            code = await call.code()
            await wait_until(lambda: not r.generate.live, 5, "router dropped the request")
            await cluster.assert_free()
            # the decode worker ended the stream as cancelled, not by finishing its 249 tokens
            aborted = cluster.decode_finished("abort") - aborted_before
            return got, code, _outcome(r, "cancelled"), r.metrics.in_flight._value.get(), aborted

    got, code, cancelled, in_flight, aborted = asyncio.run(body())
    assert code == grpc.StatusCode.CANCELLED
    assert aborted == 1
    assert len(got[0].token_ids) == 1 and sum(len(c.token_ids) for c in got) < 249
    assert cancelled == 1 and in_flight == 0


async def _stream_until_done(call) -> tuple[int, grpc.StatusCode]:
    tokens = 0
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            tokens += len(msg.token_ids)
    except grpc.aio.AioRpcError:
        pass
    return tokens, await call.code()


def test_deadline_ends_the_request_with_deadline_exceeded_and_no_leak(cluster):
    async def body():
        async with running_router(
            router_config(cluster.model, [cluster.prefill], [cluster.decode])
        ) as (r, stub):
            # expires mid-decode (the first chunk came, the rest did not); the machine's speed
            # varies, so the timeout adapts until it lands there
            timeout, tries = 0.5, []
            for _ in range(8):
                tokens, code = await _stream_until_done(
                    stub.Generate(ids_request(PROMPT, LONG), timeout=timeout)
                )
                tries.append((timeout, tokens, code))
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and tokens:
                    break
                timeout = timeout / 2 if code == grpc.StatusCode.OK else timeout * 1.5
            # expires before or during prefill
            early = await rpc_error(
                read_rest(stub.Generate(ids_request(PROMPT, LONG), timeout=0.005))
            )
            await wait_until(lambda: not r.generate.live, 5, "router dropped the requests")
            await cluster.assert_free()
            return tries, early.code(), _outcome(r, "deadline_exceeded"), _outcome(r, "cancelled")

    tries, early, deadline, cancelled = asyncio.run(body())
    _, tokens, code = tries[-1]
    assert code == early == grpc.StatusCode.DEADLINE_EXCEEDED, tries
    assert 1 <= tokens < 249
    # the router tells a deadline from a plain cancel by the time left when the call ended; on a
    # busy machine the 5 ms call may expire before it reaches the router's handler at all
    expired = 1 + sum(c == grpc.StatusCode.DEADLINE_EXCEEDED for _, _, c in tries)
    assert deadline >= 1 and expired - 1 <= deadline + cancelled <= expired


def test_abort_ends_the_stream_with_finish_reason_abort(cluster):
    async def body():
        async with running_router(
            router_config(cluster.model, [cluster.prefill], [cluster.decode])
        ) as (r, stub):
            call = stub.Generate(ids_request(PROMPT, LONG, request_id="abort-me"), timeout=60)
            first = await call.read()
            found = await stub.Abort(generate_pb2.AbortRequest(request_id="abort-me"), timeout=5)
            rest = await read_rest(call)
            again = await stub.Abort(generate_pb2.AbortRequest(request_id="abort-me"), timeout=5)
            unknown = await stub.Abort(generate_pb2.AbortRequest(request_id="nobody"), timeout=5)
            await cluster.assert_free()
            return (
                first,
                found.found,
                rest,
                again.found,
                unknown.found,
                await call.code(),
                _outcome(r, "abort"),
            )

    first, found, rest, again, unknown, code, aborted = asyncio.run(body())
    assert found and not again and not unknown
    assert code == grpc.StatusCode.OK
    last = rest[-1]
    assert last.finish_reason == generate_pb2.FINISH_REASON_ABORT
    streamed = len(first.token_ids) + sum(len(c.token_ids) for c in rest)
    assert last.usage.completion_tokens == streamed < 249 and last.usage.prompt_tokens == len(
        PROMPT
    )
    assert aborted == 1
