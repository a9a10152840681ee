"""The client side of `benchmarks/soak.py`: one streamed Generate request (optionally cancelled
by the client or aborted by id mid-stream) and the ledger of each request's terminal outcomes,
from which lost (no outcome) and duplicated (more than one) requests are counted.
"""

from __future__ import annotations

from collections import Counter

import grpc

from splitserve.protos import generate_pb2


class Ledger:
    """Request id -> terminal outcomes; a request with none is lost, with two is duplicated."""

    def __init__(self) -> None:
        self.outcomes: dict[str, list[str]] = {}
        self.aborted = 0  # streams that ended with finish reason ABORT after our Abort RPC
        self.bursts = 0  # bursts started (drive counts them)

    def start(self, rid: str) -> None:
        self.outcomes[rid] = []

    def end(self, rid: str, outcome: str) -> None:
        self.outcomes[rid].append(outcome)

    def summary(self) -> dict:
        ends = Counter(o[0] for o in self.outcomes.values() if len(o) == 1)
        return {
            "requests": len(self.outcomes),
            "succeeded": ends.pop("OK", 0),
            "cancelled": ends.pop("CANCELLED", 0),
            "failed_by_status": dict(ends),
            "lost": sum(not o for o in self.outcomes.values()),
            "duplicated": sum(len(o) > 1 for o in self.outcomes.values()),
            "aborted": self.aborted,
            "bursts": self.bursts,
        }


async def one_request(
    stub,
    ledger: Ledger,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    cancel_after: int | None,
    abort_after: int | None = None,
):
    ledger.start(rid)
    req = generate_pb2.GenerateRequest(
        request_id=rid,
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        ),
    )
    call = stub.Generate(req, timeout=60)
    tokens, finished = 0, 0
    try:
        async for chunk in call:
            tokens += len(chunk.token_ids)
            finished += chunk.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
            if cancel_after is not None and tokens >= cancel_after and not finished:
                call.cancel()
                ledger.end(rid, "CANCELLED")
                return
            if chunk.finish_reason == generate_pb2.FINISH_REASON_ABORT and abort_after == 0:
                ledger.aborted += 1
            if abort_after and tokens >= abort_after and not finished:
                abort_after = 0  # once; the stream then ends with its own last chunk (ABORT)
                await stub.Abort(generate_pb2.AbortRequest(request_id=rid), timeout=10)
        # a finished stream carries exactly one final chunk; each extra one counts as a duplicate
        for _ in range(finished):
            ledger.end(rid, "OK")
        if not finished:
            ledger.end(rid, "NO_FINAL_CHUNK")  # the stream ended cleanly without saying why
    except grpc.aio.AioRpcError as err:
        ledger.end(rid, err.code().name)
    except Exception as exc:  # anything else leaves the request without an outcome: counted lost
        print(f"  {rid}: client error {type(exc).__name__}: {exc}", flush=True)
