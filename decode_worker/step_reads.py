"""The decode engine's reading half (engine.py's step 4): a finished step's tokens read, each
row accepted (stop checks, the ITL histogram, its output), constrained rows' matchers advanced.

In a masked step (a batch with a structured-output row) the constrained rows' tokens are
consumed while the step's forward runs, then llguidance fills the masks on the engine thread
with the GIL released; from `beside_min_rows` rows the rest of the bookkeeping runs meanwhile on
a helper thread (engine/side_thread.py), otherwise the other rows are read after the sampling is
enqueued (`_rest`). `DecodeEngine` (engine.py) is the only user: these methods read and write
its scheduler, metrics and sequences.

A constrained row whose matcher hits one of the grammar engine's limits (request/constraint.py
`LIMITS`: a state reached late, past the compile's probe) ends alone with INVALID_ARGUMENT
naming the output token, whether its mask fill failed (token_masks.py `failed`: ended before its
token is read) or its token's consume did; the batch's other rows go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from splitserve.decode_worker.graph_runner import StepHandle
from splitserve.decode_worker.sequence import DecodeSequence, StepOutput
from splitserve.engine.sampler import TokenLogprobs
from splitserve.request.constraint import is_limit_error, limits_exceeded
from splitserve.request.errors import RequestError

log = logging.getLogger("splitserve.decode_worker.engine")

# a masked step reads the previous step's rows beside the mask fill from this many rows (fewer:
# the hop to the helper costs more than it saves); measured in benchmarks/decode_structured.py
BESIDE_MIN_ROWS = 8


class StepReads:
    def _read_unread(self, constrained_read: Callable[..., None] | None = None) -> None:
        """Reads the previous step, once: after this step's launch, or (a batch with
        constrained rows, whose masks need its tokens) while this step's forward runs. With
        `constrained_read` (it fills the masks; its optional argument is work to run beside
        the fill) the constrained rows' tokens are consumed first, then it runs: a batch of
        `beside_min_rows` or more reads every row beside the fill, a smaller one reads its
        constrained rows before it and leaves the others for the call after the launch, so
        their host work overlaps the masked sampling instead of delaying its launch."""
        self._end_failed_masks()  # a fill done at the launch (no previous step to read)
        if self._rest is not None:  # (before `prev`: older rows, left by a masked launch)
            rows, self._rest = self._rest, None
            self._accept_rows(rows, time.monotonic())
        prev, self._unread = self._unread, None
        if prev is not None:
            self._complete(prev, constrained_read)

    def _complete(
        self, handle: StepHandle, constrained_read: Callable[..., None] | None = None
    ) -> None:
        if handle is self._launched:  # read before the next step was launched: a host wait
            self.sync_reads += 1
        tokens, logprobs = self.graphs.read(handle)
        now = time.monotonic()
        rows = list(zip(handle.seqs, tokens, logprobs))
        if constrained_read is None:
            self._accept_rows(rows, now)
        elif len(rows) >= self.beside_min_rows:
            # the masks need only the constrained rows' tokens consumed; every row's other
            # bookkeeping runs on a helper thread while llguidance fills (engine/side_thread.py)
            self._advance_matchers([r for r in rows if r[0].matcher is not None])
            constrained_read(lambda: self._accept_rows(rows, now, advanced=True))
            self._end_failed_masks()
        else:  # few rows: the constrained first, the others after the sampling is enqueued
            self._accept_rows([r for r in rows if r[0].matcher is not None], now)
            constrained_read()
            self._end_failed_masks()
            self._rest = [r for r in rows if r[0].matcher is None]

    def _advance_matchers(self, rows: list[tuple]) -> None:
        """Constrained rows: the token appended and consumed by the matcher; a refused one ends
        its request here. `_accept(advanced=True)` does the rest. (One at a time: llguidance's
        consume_token_par took 0.2-1.1 ms for 32 rows on the H100 host, against ~0.1 ms.)"""
        for seq, tok, _ in rows:
            if seq.finished:
                continue
            seq.output_token_ids.append(tok)
            self._advance(seq, tok)

    def _advance(self, seq: DecodeSequence, token: int) -> bool:
        """The matcher consumes out[-1]; False (the request ended) when it refuses it. (A
        matcher whose mask failed allowed only EOS, and consumes it: an error all the same.)"""
        if seq.advance_matcher(token) and not seq.matcher.is_error():
            return True
        self._refused(seq, token)
        return False

    def _refused(self, seq: DecodeSequence, token: int) -> None:
        why = seq.matcher.get_error()
        if is_limit_error(why):
            self._over_limits(seq, len(seq.output_token_ids), why)
            return
        log.error("%s: token %d broke its constraint: %s", seq.request_id, token, why)
        err = RequestError(grpc.StatusCode.INTERNAL, f"the constraint failed: {why}")
        self.abort(seq.request_id, "error", err)

    def _over_limits(self, seq: DecodeSequence, n: int, why: str) -> None:
        """Output token n's mask or consume hit a grammar engine limit: INVALID_ARGUMENT (the
        same request fails the same way again), blocks freed now. The grammar's compiles are
        dropped: a lexer that hit a limit is broken for every copy sharing it (copies of it in
        other rows fail at their next mask, with the same message)."""
        log.warning(
            "%s: its constraint hit a grammar engine limit at output token %d: %s",
            seq.request_id,
            n,
            why,
        )
        self.grammars.discard(seq.params.constraint)
        self.abort(seq.request_id, "error", RequestError.invalid(limits_exceeded(n, why)))

    def _end_failed_masks(self) -> None:
        """Rows whose mask fill failed (token_masks.py): their token is in flight, masked to EOS
        at most; they end now, before it is read."""
        for seq, why in self.graphs.masks.take_failed():
            if not seq.finished:
                self._over_limits(seq, len(seq.output_token_ids) + 1, why)

    def _accept_rows(self, rows: list[tuple], now: float, advanced: bool = False) -> None:
        for seq, tok, lp in rows:
            seq.in_flight -= 1
            if not seq.finished:
                self._accept(seq, tok, lp, now, advanced)

    def _accept(
        self,
        seq: DecodeSequence,
        token: int,
        logprob: TokenLogprobs | None,
        now: float,
        advanced: bool = False,
    ) -> None:
        """`advanced`: a constrained row's token is already appended and consumed
        (`_advance_matchers`)."""
        if not (advanced and seq.matcher is not None):
            seq.output_token_ids.append(token)
            if seq.matcher is not None and not self._advance(seq, token):
                return
        result = seq.stop.update(token, "")  # no text: stop strings are the servicer's
        if len(seq.output_token_ids) > 1:  # a first token sampled here ends no inter-token gap
            self.metrics.itl_seconds.observe(now - seq.last_token_time)
        seq.last_token_time = now
        if result.finished:
            self.scheduler.finish(seq)
            self.metrics.finished.labels(result.finish_reason).inc()
        started = None
        if not seq.started_reported:
            seq.started_reported = True
            started = (seq.admitted_at, now)
        self._emit(
            seq,
            StepOutput(
                seq.request_id,
                (token,),
                (logprob,),
                result.finish_reason,
                result.stop_reason,
                started=started,
            ),
        )

    def _emit(self, seq: DecodeSequence, out: StepOutput) -> None:
        try:
            seq.sink(out)
        except Exception:  # a broken consumer must not stop the batch
            log.exception("output sink of %s failed; aborting it", seq.request_id)
            self.scheduler.finish(seq)
