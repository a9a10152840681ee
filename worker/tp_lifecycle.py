"""Rank 0 of a tensor-parallel worker after losing a follower: it cannot serve any more.

follower dies ─▶ RankSet.watch fires (not during a clean stop) ─▶ the worker:
    health NOT_SERVING, in-flight requests UNAVAILABLE, `lost` set
serve_until_lost(): the failed calls send their status, the server stops
exit_after_rank_loss(): the other followers are killed, the process exits 1 (its
    orchestrator restarts it)
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import threading
from typing import NoReturn

RANK_LOST_GRACE_S = 2.0  # failed calls send their UNAVAILABLE within this, then the worker exits
EXIT_BACKSTOP_S = 2.0  # the process ends by then whatever the exit path waits on


async def serve_until_lost(server, lost: asyncio.Event) -> int:
    """A worker's serve loop: until SIGTERM/SIGINT (drained, returns the signal) or until `lost` is
    set (a rank died): then the failed calls get RANK_LOST_GRACE_S to send their status and the
    server stops (returns 0)."""
    serving = asyncio.ensure_future(server.serve_until_signal())
    waiting = asyncio.ensure_future(lost.wait())
    await asyncio.wait([serving, waiting], return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if not serving.done():  # not cancelled: that would cancel the server's own shutdown future
        await server.drain(RANK_LOST_GRACE_S)  # serve_until_signal sees the server stop and returns
    return await serving


def exit_after_rank_loss(ranks, log: logging.Logger) -> NoReturn:
    """Rank 0 after losing a follower (in-flight requests failed, health NOT_SERVING, server
    drained): kills the other followers and exits 1, so its orchestrator restarts it. A hard exit:
    a thread may still wait in a collective with the dead rank (NCCL never gives up), which would
    hold a normal interpreter exit forever."""
    # a backstop first: flushing the log takes handler locks another thread may hold (a decode
    # worker once failed to exit within 20 s after logging the line below, on a loaded machine)
    backstop = threading.Timer(EXIT_BACKSTOP_S, os._exit, args=(1,))
    backstop.daemon = True
    backstop.start()
    # and one that needs no GIL (a thread stuck in C holding it starves the timer above; fresh
    # CI saw a worker log the line below and still run 20 s later): faulthandler's C watchdog
    # dumps the stacks and exits 1
    faulthandler.dump_traceback_later(EXIT_BACKSTOP_S + 1, exit=True)
    if ranks is not None:
        ranks.kill()
    log.error("exiting with status 1 after losing a tensor-parallel rank; restart the worker")
    logging.shutdown()
    os._exit(1)
