"""The prefill worker and constraints past the grammar engine's limits (an in-process worker on
a real gRPC server, tiny model): one that blows them at its start is INVALID_ARGUMENT from the
compile (nothing allocated); token 0's mask on a compile whose lexer broke is INVALID_ARGUMENT
at output token 1, not an EOS "stop" that the router would pass on as an answer. Counted once
as invalid_argument; every block free after."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prefill_helpers import prefill_request, release, serving, worker_config

from splitserve.protos import generate_pb2
from splitserve.request.constraint import Constraint, is_limit_error, lowest_allowed

SP = generate_pb2.SamplingParams
LATE = "x+|y(a{1000}){1000}"  # healthy at token 0; past the lexer's fuel once "y" is taken


def _break_lexer(engine, c: Constraint) -> None:
    """A copy of the cached compile walks into the blown state (as a decode row would): the
    lexer it shares with every copy breaks."""
    tok = engine.grammars.tokenizer()
    walker = engine.grammars.compile_now(c)
    assert walker.consume_token(tok.tokenize_str("y")[0])
    bits = walker.compute_bitmask()
    if not walker.is_error():
        walker.consume_token(lowest_allowed(bits, tok.eos_tokens))
    assert is_limit_error(walker.get_error())


def test_constraints_past_the_limits_are_invalid_argument_at_the_prefill_worker(tiny_llama):
    cfg = worker_config(tiny_llama)

    async def body():
        async with serving(cfg) as (worker, stub):
            engine = worker.engine
            sp = SP(regex="(a{1000}){1000}", max_tokens=4)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(prefill_request("blown", [1, 2, 3], sp))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "exceeds the grammar engine's limits" in err.value.details()
            assert "too many expressions constructed" in err.value.details()
            # token 0 of a compile whose (shared) lexer broke
            engine.grammars.lineages = 1
            late = Constraint(kind="regex", text=LATE)
            engine.grammars.compile_now(late)
            _break_lexer(engine, late)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(prefill_request("late", [1, 2, 3], SP(regex=LATE, max_tokens=4)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            details = err.value.details()
            assert "exceeded the grammar engine's limits at output token 1" in details, details
            assert engine.grammars.compiled_count(late) == 0  # the broken compile is gone
            assert engine.allocator.num_free == engine.allocator.num_usable
            # the next request of it compiles afresh and gets its token 0; the worker serves on
            got = await stub.Prefill(
                prefill_request("again", [1, 2, 3], SP(regex=LATE, max_tokens=4))
            )
            assert engine.grammars.tokenizer().decode_str([got.first_token_id])[0] in "xy"
            await release(stub, got)
            count = worker.metrics.registry.get_sample_value(
                "splitserve_prefill_requests_total", {"outcome": "invalid_argument"}
            )
            assert count == 2

    asyncio.run(body())
