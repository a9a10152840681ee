"""Decides when a sequence finishes and which part of its text may be streamed now.

Rules, in vLLM's order, checked after each generated token:

1. the eos token (unless `ignore_eos`)      -> "stop", stop_reason None
2. a token in `stop_token_ids`               -> "stop", stop_reason = that id
   (the text of the token in 1 and 2 is dropped unless `include_stop_str_in_output`)
3. a stop string in the output text          -> "stop", stop_reason = that string; the
   text is cut before it (after it with `include_stop_str_in_output`); the earliest
   match wins, and at one position the string listed first
4. `max_tokens` generated, or prompt + output reaching `max_model_len` -> "length"

Before `min_tokens` tokens were generated, 1 to 3 end nothing (vLLM): the sampler bans eos and
`stop_token_ids` on the device until then, and a stop string that ends there is ordinary text.
A stop string counts only when it ends in a token from `min_tokens` on (it may start earlier).

Streaming: a stop string can arrive split over several tokens ("</" then "end>"), so the
tail of the text that could still become a stop string is held back (shorter than the longest
stop string). A stop string can therefore never start inside text already streamed. Matching is
incremental (stop_strings.py: one Aho-Corasick automaton per request): each token's text delta
is scanned once, in time linear in the delta however many stop strings there are; nothing is
rescanned. When the sequence finishes for any other reason, the held tail is released, so the
concatenation of all `StopResult.text` is the final output text.

Where it runs: on the router's event loop (router/output.py) and in the single-process engine
(engine/offline.py). The workers' engine threads build theirs with `match_stop_strings=False`:
the decode worker matches stop strings on its event loop instead (decode_worker/stop_strings.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from splitserve.request.stop_strings import StopStringMatcher

FinishReason = Literal["stop", "length"]


class StopParams(Protocol):
    """The fields of SamplingParams this module reads (duck-typed)."""

    max_tokens: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    min_tokens: int


@dataclass(frozen=True, slots=True)
class StopResult:
    text: str  # text that may be streamed now ('' while held back)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # matched stop string or stop token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopChecker:
    """Per-sequence stop state; call `update` once per generated token."""

    def __init__(
        self,
        params: StopParams,
        eos_token_ids: Sequence[int],
        max_model_len: int,
        prompt_len: int,
        *,
        match_stop_strings: bool = True,
    ) -> None:
        """`match_stop_strings=False`: `params.stop` is left to another thread (the workers' engine
        threads never match text; see the module doc)."""
        if prompt_len >= max_model_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens leaves no room to generate within "
                f"max_model_len={max_model_len}; shorten the prompt"
            )
        if params.max_tokens is not None and params.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
        self._max_tokens = params.max_tokens
        stops = tuple(s for s in params.stop or () if s) if match_stop_strings else ()
        self._strings = StopStringMatcher(stops) if stops else None
        self._stop_token_ids = frozenset(params.stop_token_ids or ())
        self._include_stop = params.include_stop_str_in_output
        self._eos = frozenset(()) if params.ignore_eos else frozenset(eos_token_ids)
        self._min_tokens = params.min_tokens
        self._max_model_len = max_model_len
        self._prompt_len = prompt_len
        self._held = ""  # tail of the output that may be the start of a stop string
        self.num_generated = 0
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_id: int, text_delta: str) -> StopResult:
        """Account for one generated token and the text the detokenizer gave for it."""
        if self.finished:
            raise RuntimeError(f"sequence already finished ({self.finish_reason}); no more tokens")
        self.num_generated += 1
        # vLLM's min_tokens: no stop condition (eos, stop ids, stop strings) ends the request
        # before that many tokens; max_tokens / max_model_len still do.
        may_stop = self.num_generated >= self._min_tokens

        if may_stop and (token_id in self._eos or token_id in self._stop_token_ids):
            reason = None if token_id in self._eos else token_id
            tail = text_delta if self._include_stop else ""
            return self._finish(self._held + tail, "stop", reason)

        text = self._held + text_delta
        match = self._strings.feed(text_delta, may_stop) if self._strings is not None else None
        if match is not None:
            index = len(text) - match.back
            end = index + len(match.stop) if self._include_stop else index
            return self._finish(text[:end], "stop", match.stop)

        if (self._max_tokens is not None and self.num_generated >= self._max_tokens) or (
            self._prompt_len + self.num_generated >= self._max_model_len
        ):
            return self._finish(text, "length", None)

        keep = self._strings.partial_len if self._strings is not None else 0
        self._held = text[len(text) - keep :] if keep else ""
        return StopResult(text[: len(text) - keep])

    @property
    def held(self) -> str:
        """The tail held back now (shorter than the longest stop string)."""
        return self._held

    def end(self) -> str:
        """Ends the sequence for a reason decided elsewhere (another process's limit, an
        abort); returns the text held back so far, so no streamed text is lost."""
        held, self._held = self._held, ""
        return held

    def _finish(self, text: str, reason: FinishReason, stop_reason: str | int | None) -> StopResult:
        self._held = ""
        self.finish_reason = reason
        return StopResult(text, reason, stop_reason)
