"""Runs the decode engine on a thread of its own; other threads talk to it through commands.

    gRPC handlers (event loop)                   engine thread (owns the engine, the model)
    ──────────────────────────                   ──────────────────────────────────────────
    submit(input, sink)  ──command──▶            apply commands (submit / admit / abort)
    abort(request_id)    ──command──▶ Future     step()  (one decode step, see engine.py)
    sink(StepOutput)     ◀── call_soon_threadsafe ─┘      ... while there is work, else wait

A dedicated thread (rather than the event loop) keeps the steady loop free of the event
loop's scheduling between steps. Commands are applied at the top of every iteration, so an
abort frees its blocks before the next step. A step that raises is fatal: every request ends
with UNAVAILABLE, `fatal` is set and `on_fatal` is called (health goes NOT_SERVING).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from splitserve.decode_worker.engine import DecodeEngine
from splitserve.decode_worker.sequence import DecodeInput, Sink, StepOutput
from splitserve.request.errors import RequestError

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(
        self, engine: DecodeEngine, on_fatal: Callable[[BaseException], None] | None = None
    ) -> None:
        self.engine = engine
        self.fatal: BaseException | None = None
        self.progress = 0  # bumped after every step and every batch of commands (stall_watch.py)
        self._on_fatal = on_fatal
        self._cmds: deque[Callable[[], None]] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the loop after the current step; what is left gets UNAVAILABLE. Idempotent."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    @property
    def busy(self) -> bool:
        return self.engine.has_work or bool(self._cmds)

    # ---- commands (any thread) ---------------------------------------------------------------------
    def _post(self, cmd: Callable[[], None]) -> bool:
        with self._cv:
            if self._stopping or self.fatal is not None:
                return False
            self._cmds.append(cmd)
            self._cv.notify()
        return True

    def _refusal(self) -> RequestError:
        if self.fatal is not None:
            return RequestError.unavailable(
                f"the decode engine failed ({self.fatal!r}); retry on another decode worker"
            )
        return RequestError.unavailable(
            "the decode worker is shutting down; retry on another decode worker"
        )

    def submit(self, inp: DecodeInput, sink: Sink, block_ids: Sequence[int] | None = None) -> None:
        """Queues a request (KV present in `block_ids`, or None: recompute it). A refusal
        arrives through `sink` as a final StepOutput with finish_reason "error"."""

        def cmd() -> None:
            try:
                if block_ids is None:
                    self.engine.submit(inp, sink)
                else:
                    self.engine.admit(inp, block_ids, sink)
            except RequestError as err:
                sink(StepOutput(inp.request_id, finish_reason="error", error=err))

        if not self._post(cmd):
            sink(StepOutput(inp.request_id, finish_reason="error", error=self._refusal()))

    def reserve_blocks(self, num_blocks: int) -> Future[list[int] | None]:
        """The KV-transfer seam: `num_blocks` blocks for a pull into this pool (None when the
        pool is short right now). Once the KV is in, `submit(input, sink, block_ids)` hands
        them to the engine; if the pull fails, `release_blocks(block_ids)`. The pull's stream
        must wait for the engine's stream first (kvtransfer's `after_engine()`): a block freed
        a moment ago may still be written by the step in flight."""
        fut: Future[list[int] | None] = Future()

        def cmd() -> None:
            if not fut.set_running_or_notify_cancel():  # the caller gave up (cancelled) first
                return
            fut.set_result(self.engine.reserve_blocks(num_blocks))

        if not self._post(cmd) and fut.set_running_or_notify_cancel():
            fut.set_result(None)
        return fut

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Gives back blocks from `reserve_blocks` that never reached `submit`."""
        if not self._post(lambda: self.engine.release_blocks(block_ids)):
            log.debug("engine stopped; %d reserved blocks die with the pool", len(block_ids))

    def call(self, fn: Callable[[], object]) -> Future:
        """Runs `fn` on the engine thread between steps (ordered with them); its result or
        exception in the future (a stopped engine: RuntimeError)."""
        fut: Future = Future()

        def cmd() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

        if not self._post(cmd) and fut.set_running_or_notify_cancel():
            fut.set_exception(RuntimeError("the decode engine is not running"))
        return fut

    def abort(self, request_id: str, reason: str = "abort") -> Future[bool]:
        """Ends a request between steps; `reason` "stop" when the servicer matched a stop
        string (stop_strings.py), so the metrics count it as stopped, not aborted."""
        fut: Future[bool] = Future()

        def cmd() -> None:
            found = self.engine.abort(request_id, reason)
            if fut.set_running_or_notify_cancel():
                fut.set_result(found)

        if not self._post(cmd) and fut.set_running_or_notify_cancel():
            fut.set_result(False)
        return fut

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            device = self.engine.runner.device
            if device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)  # replays launch on this thread's current device
            while True:
                with self._cv:
                    while not self._cmds and not self._stopping and not self.engine.has_work:
                        self._cv.wait()
                    cmds, self._cmds = self._cmds, deque()
                    stopping = self._stopping
                for cmd in cmds:
                    cmd()
                if cmds:
                    self.progress += 1
                    self.engine.blocked = False  # a command may have freed or brought blocks
                if stopping:
                    break
                if self.engine.has_work:
                    if delay := self.engine.cfg.faults.step_delay(
                        self.engine.scheduler.by_id
                    ):  # tests only
                        time.sleep(delay)
                    self.engine.step()
                    self.progress += 1
        except BaseException as exc:  # noqa: BLE001 - any failure of a step is fatal for the worker
            log.exception("decode engine failed; the worker stops serving")
            with self._cv:
                self.fatal = exc
            if self._on_fatal is not None:
                self._on_fatal(exc)
        finally:
            with self._cv:  # no command is posted from now on; the queued ones still answer
                self._stopping = True
                cmds, self._cmds = self._cmds, deque()
            for cmd in cmds:
                try:
                    cmd()
                except Exception:
                    log.exception("command after the engine stopped")
            self.engine.close(self._refusal())
