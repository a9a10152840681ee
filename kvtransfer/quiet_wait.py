"""The KV transfer's sends and receives (the listener's, a pull's lease request and payload, a
streamed piece's header and payload), awaited without spinning the event loop.

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


class Posted:
    """Sends or receives posted on an endpoint at once (`post`), awaited later with `wait`:
    a reply header posted where it is built goes out before the loop's next turn, not when a
    task created for it first runs. On a failure (or `abandon`) the buffers are parked: UCX may
    use them until the endpoint's abort ends."""

    def __init__(self, buffers: list, arrays: list, requests: list | None, task=None) -> None:
        self.buffers, self.arrays, self.requests, self.task = buffers, arrays, requests, task
        self.done = False

    async def wait(self, timeout: float) -> None:
        try:
            if self.task is not None:  # another ucxx: its own awaits, run as a task
                await asyncio.wait_for(asyncio.shield(self.task), timeout)
            else:
                await until_complete(self.requests, timeout)
        except BaseException:
            self.abandon()
            raise
        self.done = True

    def abandon(self) -> None:
        if not self.done:
            if self.task is not None:
                self.task.cancel()
            frames.park(self.buffers, self.arrays)
            self.done = True


def _through_ucxx(ep, buffers: list, receive: bool, tag) -> Posted:
    """Another ucxx, or a receive on a failed endpoint: ucxx's own awaits, run as a task (not
    posted before the loop's next turn)."""
    op = ep.recv if receive else ep.send
    task = asyncio.ensure_future(asyncio.gather(*(op(b, tag=tag) for b in buffers)))
    task.add_done_callback(retrieve_exception)  # an abandoned one's failure is not an error
    return Posted(buffers, [], None, task)


def retrieve_exception(fut: asyncio.Future) -> None:
    """A done-callback for a future whose failure is not an error: asyncio logs none for it."""
    if not fut.cancelled():
        fut.exception()


async def wait_all(posts: list, timeout: float) -> None:
    """Waits for each of `posts` in turn, all within one `timeout`."""
    deadline = time.monotonic() + timeout
    for posted in posts:
        await posted.wait(max(0.0, deadline - time.monotonic()))


def post(ep, buffers: list, receive: bool = False, tag=None) -> Posted:
    """Posts a send (or receive) of each of `buffers` now, in order (UCX matches them in
    order); raises ConnectionError where the endpoint is closed."""
    if not _supported(ep):
        return _through_ucxx(ep, buffers, receive, tag)
    from ucxx._lib.arr import Array
    from ucxx.types import TagMaskFull

    try:
        inner = _raw(ep)
    except Exception:
        if not receive:
            raise
        # ucxx's own recv still takes a message that came before the endpoint failed
        return _through_ucxx(ep, buffers, receive, tag)
    arrays = [Array(b) for b in buffers]
    requests: list = []
    try:
        if receive:
            wire = _wire_tag(ep, "msg_recv", tag)
            requests += (inner.tag_recv(a, wire, TagMaskFull) for a in arrays)
        else:
            wire = _wire_tag(ep, "msg_send", tag)
            requests += (inner.tag_send(a, wire) for a in arrays)
    except BaseException:
        frames.park(buffers, arrays)  # those posted before the failure may still be in use
        raise
    return Posted(buffers, arrays, requests)


async def send_all(ep, buffers: list, timeout: float, tag=None) -> None:
    """Sends `buffers` (posted at once: tag-ordered); on a failure they are parked."""
    await post(ep, buffers, tag=tag).wait(timeout)


async def recv_all(ep, buffers: list, timeout: float, tag=None) -> None:
    """Receives into `buffers` (posted at once: matched in order), one waiter for all of them
    (a slab-framed payload has 32+); on a failure the buffers are parked."""
    await post(ep, buffers, receive=True, tag=tag).wait(timeout)


def post_frame(ep, msg) -> Posted:
    return post(ep, [frames.encode(msg)])


async def send_frame(ep, msg, timeout: float) -> None:
    await post_frame(ep, msg).wait(timeout)


async def recv_frame(ep, cls, buf, timeout: float):
    """The next control frame on `ep`, decoded (ValueError when malformed)."""
    await post(ep, [buf], receive=True).wait(timeout)
    return frames.decode(buf, cls)
