"""engine/side_thread.py: the helper that runs Python work while the caller sits in native code
(the decode engine's mask fill)."""

from __future__ import annotations

import threading

import pytest

from splitserve.engine.side_thread import SideThread


def test_side_runs_on_the_helper_while_main_runs_here():
    side = SideThread("t-side")
    seen: dict[str, str] = {}
    started = threading.Event()

    def side_work() -> None:
        seen["side"] = threading.current_thread().name
        started.set()

    def main_work() -> int:
        seen["main"] = threading.current_thread().name
        # main waits (GIL released) until the side has run: they overlap, or this times out
        assert started.wait(30), "the side job never started while main ran"
        return 7

    try:
        assert side.beside(side_work, main_work) == 7
        assert seen == {"side": "t-side", "main": threading.current_thread().name}
        assert side.beside(lambda: None, lambda: 8) == 8  # the same thread serves again
        assert side.jobs_run == 2
    finally:
        side.close()


def test_the_caller_returns_only_after_the_side_job_ended():
    side = SideThread("t-side")
    done: list[str] = []
    main_ended = threading.Event()

    def slow() -> None:
        assert main_ended.wait(30)  # ends only after main has returned
        done.append("side")

    def main() -> None:
        done.append("main")
        main_ended.set()

    try:
        side.beside(slow, main)
        assert done == ["main", "side"]
    finally:
        side.close()


def test_errors_reach_the_caller_and_the_helper_keeps_serving():
    side = SideThread("t-side")

    def boom() -> None:
        raise ValueError("side failed")

    def main_fails() -> None:
        raise KeyError("main failed")

    try:
        with pytest.raises(ValueError, match="side failed"):
            side.beside(boom, lambda: None)
        with pytest.raises(KeyError, match="main failed") as raised:  # main's error wins ...
            side.beside(boom, main_fails)
        assert "side failed" in "".join(raised.value.__notes__)  # ... and names the side's
        assert side.beside(lambda: None, lambda: "ok") == "ok"
    finally:
        side.close()


def test_close_ends_the_thread_and_refuses_new_work():
    side = SideThread("t-side")
    side.beside(lambda: None, lambda: None)
    thread = side._thread
    side.close()
    side.close()  # idempotent
    assert thread is not None and not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        side.beside(lambda: None, lambda: None)
