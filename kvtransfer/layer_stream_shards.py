"""A streamed pull across a tensor-parallel prefill's shards (shards.py for the plan).

    prefill TP2: rank 1 listener ── stream of heads [h,2h) ──▶ final (no lease) ─▶ KvPullDone
                 rank 0 listener ── stream of heads [0,h)  ──▶ final (first token, lease)
                                      waits for every other shard to land ─▶ KvPullDone (lease
                                      released on the prefill side)

Every shard streams at once while the prefill computes (each rank's engine step feeds its own
listener); only rank 0's KvPullDone releases the lease, so it goes out last, once every shard
has landed. Any shard failing aborts the others and fails the whole pull (the lease untouched:
the caller falls back to the classic pull). A TP1 prefill is the one-shard case.
"""

from __future__ import annotations

import asyncio

from splitserve.kvtransfer.layer_stream_client import LayerStreamClient, StreamResult
from splitserve.kvtransfer.shards import ShardSource


async def stream_shards(
    client: LayerStreamClient,
    sources: list[ShardSource],
    request_id: str,
    num_tokens: int,
    dest: list[int],
    token: str,
) -> StreamResult:
    """`sources` rank 0 last (shard_sources); returns rank 0's result (first token, lease) once
    every shard's last piece landed. Ends only after every shard's pull ended (none still writes
    into `dest`), so a failure can give the blocks back at once."""
    followers = [
        asyncio.ensure_future(
            client.pull(
                s.host, s.port, request_id, num_tokens, dest, token, (s.head_start, s.head_end)
            )
        )
        for s in sources[:-1]
    ]

    async def others_landed() -> None:
        await asyncio.gather(*followers)

    last = sources[-1]
    main = asyncio.ensure_future(
        client.pull(
            last.host,
            last.port,
            request_id,
            num_tokens,
            dest,
            token,
            (last.head_start, last.head_end),
            others_landed if followers else None,
        )
    )
    tasks = [*followers, main]
    first: BaseException | None = None  # the real failure, not a shard aborted because of it
    try:
        pending = set(tasks)
        while pending and first is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t.exception() for t in done if not t.cancelled() and t.exception()]
            if failed:
                first = failed[0]
                client.abort(request_id)  # the other shards' streams end at once
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        client.abort(request_id)
        await asyncio.wait(tasks)  # no shard may still write when the caller frees the blocks
        raise
    finally:
        client.forget(request_id)
    for t in tasks:  # every shard's outcome retrieved: the aborted ones' failures are expected
        if not t.cancelled():
            t.exception()
    if first is not None:
        raise first
    return main.result()
