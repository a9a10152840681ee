"""kv_transfer.progress_wait_ms: the default (100 ms; ucxx's 1 ms on CUDA when the thread does not
poll while busy), 0 refused (a spinning thread), and applied: a transfer between two
processes still works with the thread waiting 100 ms or for events only (the idle CPU bound is
tests/kvtransfer/test_handover_processes.py's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.progress_wait import progress_wait_ms


def _run_ok(code: str) -> None:
    """`code` in a fresh interpreter (one ucxx context per process); it prints "ok" at the end."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"},
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_defaults_and_refusal():
    assert progress_wait_ms(None, "cpu") == 100 and progress_wait_ms(None, "cuda") == 100
    assert progress_wait_ms(None, "cuda", polls=False) == 1  # completions would wait
    assert progress_wait_ms(None, "cpu", polls=False) == 100
    assert progress_wait_ms(7, "cuda") == 7 and progress_wait_ms(-1, "cpu") == -1
    assert KvTransferConfig(progress_wait_ms=-1).progress_wait_ms == -1
    with pytest.raises(ValueError, match="spin"):
        KvTransferConfig(progress_wait_ms=0)
    with pytest.raises(ValueError):
        KvTransferConfig(progress_wait_ms=-2)


@pytest.mark.parametrize("wait", ["100", "-1"])
def test_transfers_work_with_a_long_wait(wait):
    code = f"""
import asyncio
import numpy as np
import ucxx
from splitserve.kvtransfer.progress_wait import apply_progress_wait

async def main():
    async def handler(ep):
        buf = np.empty(4096, np.uint8)
        for _ in range(3):
            await ep.recv(buf)
            await ep.send(buf)
    lst = ucxx.create_listener(handler)
    assert apply_progress_wait({wait})
    ep = await ucxx.create_endpoint("127.0.0.1", lst.port)
    msg, back = np.arange(4096, dtype=np.uint8), np.empty(4096, np.uint8)
    for pause in (0, 0.3, 0.3):  # after idling too: events wake the thread (-1: only they do,
        await asyncio.sleep(pause)  # so a missed wake-up would never complete: 30 s says so)
        await asyncio.wait_for(ep.send(msg), 30)
        await asyncio.wait_for(ep.recv(back), 30)
        assert (back == msg).all()
    await ep.close()
    lst.close()

asyncio.run(main())
print("ok")
"""
    _run_ok(code)


def test_poll_while_busy_defaults():
    from splitserve.kvtransfer.progress_wait import poll_while_busy

    assert poll_while_busy(None, "cuda") and not poll_while_busy(None, "cpu")
    assert poll_while_busy(True, "cpu") and not poll_while_busy(False, "cuda")


def test_polls_while_busy_then_waits_again():
    """With poll_while_busy on, the thread polls from the first transfer on (one switch), stays
    polling across back-to-back transfers and between them, and goes back to its wait
    LINGER_S after the last one; transfers in either mode complete."""
    code = """
import asyncio
import numpy as np
import ucxx
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.progress_wait import BOOST, set_up_progress

async def main():
    async def handler(ep):
        buf = np.empty(4096, np.uint8)
        for _ in range(5):
            await ep.recv(buf)
            await ep.send(buf)
    lst = ucxx.create_listener(handler)
    set_up_progress(KvTransferConfig(poll_while_busy=True), "cpu")
    BOOST.linger_s = 0.2
    assert BOOST.enabled and not BOOST.polling and BOOST.idle_ms == 100
    ep = await ucxx.create_endpoint("127.0.0.1", lst.port)
    msg, back = np.arange(4096, dtype=np.uint8), np.empty(4096, np.uint8)

    async def transfer():
        with BOOST.busy():
            assert BOOST.polling
            await asyncio.wait_for(ep.send(msg), 30)
            await asyncio.wait_for(ep.recv(back), 30)
        assert (back == msg).all()

    await asyncio.gather(transfer(), transfer())  # two at once: one switch
    await transfer()  # within the linger: no switch
    assert BOOST.switches == 1 and BOOST.polling
    await asyncio.sleep(0.6)
    assert BOOST.switches == 2 and not BOOST.polling  # back to waiting 100 ms
    await transfer()  # polling again
    assert BOOST.switches == 3
    await transfer()
    await ep.close()
    lst.close()
    BOOST.rest_now()  # a transfer owner's close: back to waiting without the linger
    assert BOOST.switches == 4 and not BOOST.polling

asyncio.run(main())
print("ok")
"""
    _run_ok(code)


def test_a_failed_switch_turns_polling_off_and_counts_nothing(monkeypatch):
    from splitserve.kvtransfer import progress_wait

    boost = progress_wait.ProgressBoost()
    boost.configure(True)
    calls = []

    def broken(polling, wait_ms):
        calls.append(polling)
        raise RuntimeError("no thread")

    monkeypatch.setattr(progress_wait, "_restart_thread", broken)
    with boost.busy():  # the transfer still runs, without polling
        assert not boost.polling
    # tried to poll, then to put the waiting thread back; off from then on, nothing counted
    assert calls == [True, False] and not boost.enabled and boost._active == 0
    with boost.busy():
        pass
    assert calls == [True, False]
