"""Structured output in the decode step: the masks of a batch's constrained rows.

Before a step whose batch has a constrained row launches, the host asks each matcher (already
advanced with the row's last token, engine.py) for its allowed next tokens, into a pinned
[max_batch, W] int32 buffer (all ones for the other rows), and copies it into the device
buffer that the MASK graph variants read (graph_runner.py: `sample_step(token_mask=...)`).
A batch without a constrained row never touches either buffer.

The host work overlaps the device: the step's forward is enqueued first (the MASK variants are
two graphs, forward and sampling), then the engine reads the previous step's constrained rows
and advances their matchers, then the masks are filled and copied, then the sampling is
enqueued. The previous step's other bookkeeping (stop checks, metrics, outputs of every row)
runs on a helper thread while llguidance fills (`SideThread`, from `beside_min_rows` rows), or,
in a smaller batch, after the sampling is enqueued (engine.py `_read_unread`).
The pinned buffer is rewritten only after the previous step was read, i.e. after its mask copy.

Rows whose matchers stand in one state (same constraint, same tokens so far: the forced
opening of a schema, `n` choices, identical prompts) are filled once (`same_state`).

A row whose fill hits a grammar engine limit (llguidance then allows it only EOS) is kept in
`failed`, with the engine's message, for the engine to end (step_reads.py); so is a row that
copied its mask. The other rows' masks are theirs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from splitserve.decode_worker.sequence import DecodeSequence
from splitserve.engine.grammar_masks import fill_masks, mask_words
from splitserve.engine.side_thread import SideThread


class TokenMasks:
    def __init__(self, max_batch_size: int, vocab: int, device: torch.device) -> None:
        words = mask_words(vocab)
        pin = device.type == "cuda"
        self.host = torch.full((max_batch_size, words), -1, dtype=torch.int32, pin_memory=pin)
        self.device = torch.full((max_batch_size, words), -1, dtype=torch.int32, device=device)
        self.steps = 0  # masked steps launched, for tests and metrics
        self.shared_rows = 0  # rows that copied another row's mask (same matcher state)
        self.fill_seconds = 0.0  # host time filling masks (the benchmark reports it per step)
        self.on_fill: Callable[[float], None] | None = None  # seconds per masked step (metrics)
        self._filled: int | None = None  # shared rows of the fill `start` did, until `finish`
        self._fill_s = 0.0  # the fill's host time, for `finish` to report
        self.side = SideThread("mask-side")  # reads rows beside the fill (`start`)
        self.failed: list[tuple[DecodeSequence, str]] = []  # rows whose fill failed, and why

    @staticmethod
    def constrained(seqs: Sequence[DecodeSequence]) -> bool:
        return any(s.matcher is not None for s in seqs)

    def start(
        self, seqs: Sequence[DecodeSequence], beside: Callable[[], None] | None = None
    ) -> None:
        """Fills the host buffer, on the calling thread (llguidance's threads do the work, the
        GIL released); `beside` runs on `side`'s helper thread meanwhile (engine/side_thread.py:
        the previous step's bookkeeping), or after the fill if no row needs a walk. (A helper
        thread that filled while the engine read the rows was measured slower on the H100:
        1.54x unconstrained at batch 64 against 1.24x inline: it got the GIL late.)"""
        t0 = time.perf_counter()
        # a row that just finished (its last token read while this step's forward ran) is a
        # wasted lane: any mask will do, and its matcher may be past its end
        matchers = [None if s.finished else s.matcher for s in seqs]
        same = same_state(seqs, matchers)
        t1 = time.perf_counter()
        took = fill_masks(matchers, self.host.numpy(), same, beside, self.side)
        self._filled = len(same) - same.count(None)
        self._fill_s = t1 - t0 + took  # not the rows read beside the fill
        errors = [None if m is None or not m.is_error() else m.get_error() for m in matchers]
        for i, seq in enumerate(seqs):  # (a copied row shares its lead's fate: same state)
            why = errors[i] if same[i] is None else errors[same[i]]
            if why is not None:
                self.failed.append((seq, why))

    def take_failed(self) -> list[tuple[DecodeSequence, str]]:
        """The rows whose fills failed since the last call (and the engine's messages)."""
        failed, self.failed = self.failed, []
        return failed

    def close(self) -> None:
        self.side.close()

    def finish(self, seqs: Sequence[DecodeSequence]) -> None:
        """Rows [:len(seqs)] of the device buffer <- the rows' masks (stream-ordered): takes
        the fill done by `start` (done here if `start` was not called) and enqueues the copy."""
        if self._filled is None:
            self.start(seqs)
        self.shared_rows += self._filled
        self._filled = None
        n, t_copy = len(seqs), time.perf_counter()
        self.device[:n].copy_(self.host[:n], non_blocking=True)
        self.steps += 1
        took = self._fill_s + time.perf_counter() - t_copy  # not the rows read meanwhile
        self.fill_seconds += took
        if self.on_fill is not None:
            self.on_fill(took)


def same_state(
    seqs: Sequence[DecodeSequence], matchers: Sequence[object | None]
) -> list[int | None]:
    """[i] = j < i when row i's matcher stands where row j's does, else None. The fingerprint
    (sequence.py) finds candidates in O(1); equal token lists prove it (the matcher's state is a
    function of its constraint and the tokens it consumed)."""
    first: dict[tuple, int] = {}
    out: list[int | None] = [None] * len(seqs)
    for i, (s, m) in enumerate(zip(seqs, matchers)):
        if m is None:
            continue
        # (Constraint.key would rebuild the grammar text: ~0.1 ms a row, a step's budget)
        j = first.setdefault((s.grammar_fp, len(s.output_token_ids)), i)
        lead = seqs[j]
        if (
            j != i
            and lead.output_token_ids == s.output_token_ids
            and lead.params.constraint == s.params.constraint
        ):
            out[i] = j
    return out
