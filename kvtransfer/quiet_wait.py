"""The KV transfer's sends and receives (the listener's, and a pull's payload), awaited
without spinning the event loop.

ucxx's `await ep.send(...)` / `ep.recv(...)` wait by polling their request every loop turn
(`wait_yield`: `asyncio.sleep(0)` until completed). A pull whose peer never read its payload
(or never sent KvPullDone) kept the prefill worker's loop at a whole core for data_timeout_s,
one polling coroutine per message. Here the requests are posted on ucxx's endpoint directly
and one waiter polls them: every loop turn for SPIN_S (a transfer that ends within it pays
nothing), then with sleeps growing with the time already waited, at most MAX_SLEEP_S and
1/32 of it (a long transfer's end is found within ~3 % of its time).

Uses ucxx's endpoint internals (`_ep`, `_tags`, the tag hash of `Endpoint.send`); where they
differ (another ucxx) it falls back to ucxx's own awaits.
"""

from __future__ import annotations

import asyncio
import time

from splitserve.kvtransfer import frames

SPIN_S = 0.05
MAX_SLEEP_S = 0.01


async def until_complete(requests: list, timeout: float) -> None:
    """Returns once every request completed (raising the first one's error), TimeoutError
    after `timeout`."""
    start = time.monotonic()
    i = 0
    while True:
        while i < len(requests) and requests[i].completed:
            i += 1
        if i == len(requests):
            break
        waited = time.monotonic() - start
        if waited >= timeout:
            raise TimeoutError(f"UCX requests not complete within {timeout}s")
        if waited < SPIN_S:
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(min(MAX_SLEEP_S, max(0.001, waited / 32), timeout - waited))
    for request in requests:
        request.check_error()


def _wire_tag(ep, key: str, tag):
    """The UCX tag ucxx's Endpoint.send / recv use for `tag` (None: the endpoint's own)."""
    from ucxx._lib_async.utils import hash64bits
    from ucxx.types import Tag

    base = ep._tags[key]  # noqa: SLF001 - see the module docstring
    return Tag(base if tag is None else hash64bits(base, hash(tag)))


def _raw(ep):
    inner = getattr(ep, "_ep", None)
    if inner is None:
        raise ConnectionError("the KV endpoint is closed")
    inner.raise_on_error()
    return inner


def _supported(ep) -> bool:
    return isinstance(getattr(ep, "_tags", None), dict) and hasattr(ep, "_ep")


async def send_all(ep, buffers: list, timeout: float, tag=None) -> None:
    """Sends `buffers` (posted at once: tag-ordered); on a failure they are parked."""
    if not _supported(ep):
        await asyncio.wait_for(asyncio.gather(*(ep.send(b, tag=tag) for b in buffers)), timeout)
        return
    from ucxx._lib.arr import Array

    arrays = [Array(b) for b in buffers]
    try:
        inner, wire = _raw(ep), _wire_tag(ep, "msg_send", tag)
        await until_complete([inner.tag_send(a, wire) for a in arrays], timeout)
    except BaseException:
        frames.park(buffers, arrays)  # UCX may read them until the endpoint's abort ends
        raise


async def recv_all(ep, buffers: list, timeout: float, tag=None) -> None:
    """Receives into `buffers` (posted at once: matched in order), one waiter for all of them
    (a slab-framed payload has 32+); on a failure the buffers are parked."""
    if not _supported(ep):
        await asyncio.wait_for(asyncio.gather(*(ep.recv(b, tag=tag) for b in buffers)), timeout)
        return
    from ucxx._lib.arr import Array
    from ucxx.types import TagMaskFull

    arrays = [Array(b) for b in buffers]
    try:
        inner, wire = _raw(ep), _wire_tag(ep, "msg_recv", tag)
        await until_complete([inner.tag_recv(a, wire, TagMaskFull) for a in arrays], timeout)
    except BaseException:
        frames.park(buffers, arrays)  # UCX may write them until the endpoint's abort ends
        raise


async def send_frame(ep, msg, timeout: float) -> None:
    await send_all(ep, [frames.encode(msg)], timeout)


async def recv_frame(ep, cls, buf, timeout: float):
    """The next control frame on `ep`, decoded (ValueError when malformed)."""
    if not _supported(ep):
        return await asyncio.wait_for(frames.recv(ep, cls, buf), timeout)
    from ucxx._lib.arr import Array
    from ucxx.types import TagMaskFull

    array = Array(buf)
    try:
        request = _raw(ep).tag_recv(array, _wire_tag(ep, "msg_recv", None), TagMaskFull)
        await until_complete([request], timeout)
    except BaseException:
        frames.park(buf, array)
        raise
    return frames.decode(buf, cls)
