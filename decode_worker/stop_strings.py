"""Stop strings of one Decode stream, matched on the worker's event loop, never the engine thread.

The engine thread ends a request on eos, stop token ids and length only (engine.py builds its
StopChecker with `match_stop_strings=False`), so no text work ever delays a step. The servicer
passes each batch of StepOutputs through this filter: incremental detokenization, then the
request's StopStringMatcher (request/stop_strings.py: linear in the new text). A match cuts the
stream after the token that completes the stop string (finish_reason "stop", stop_reason the
string) and the servicer aborts the request on the engine with reason "stop": its blocks are
freed between two steps, and the tokens of the step or two it ran meanwhile are dropped.

The rules are StopChecker's (request/stop_checker.py): the prefill's first token counts (its
text too), nothing stops before min_tokens, an eos or stop token ending the same token wins
over a stop string, and a stop string wins over length.
"""

from __future__ import annotations

from splitserve.decode_worker.sequence import StepOutput
from splitserve.request.detokenizer import IncrementalDetokenizer
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.stop_strings import StopStringMatcher


class StopStringFilter:
    """One Decode stream's stop strings: `apply` each batch of the engine's outputs."""

    def __init__(
        self,
        tokenizer,
        prompt: list[int],
        params: SamplingParams,
        first_token_id: int | None,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt)
        self._matcher = StopStringMatcher(params.stop)
        self._min_tokens = params.min_tokens
        self._generated = 0
        self.stopped: str | None = None  # the stop string that cut the stream
        # a stop string completed by the prefill's first token: the stream ends at once
        self._first = None if first_token_id is None else self._match(first_token_id)

    def _match(self, token_id: int) -> str | None:
        self._generated += 1
        found = self._matcher.feed(
            self._detok.add(token_id), find=self._generated >= self._min_tokens
        )
        return None if found is None else found.stop

    def apply(self, outs: list[StepOutput]) -> list[StepOutput]:
        """`outs` (the engine's, in order), cut where a stop string ends; after a cut `stopped`
        is set and the last output ends the stream."""
        if self._first is not None:
            head = outs[0]
            if not head.token_ids and head.finish_reason in ("stop", "abort", "error"):
                return outs[:1]  # eos / a stop token on the first token, or refused: not ours
            return [self._cut(head.request_id, (), (), self._first)]
        for i, out in enumerate(outs):
            for k, token in enumerate(out.token_ids):
                stop = self._match(token)
                if stop is None:
                    continue
                if k == len(out.token_ids) - 1 and out.finish_reason == "stop":
                    return outs[: i + 1]  # the engine's eos / stop token on this token wins
                return [*outs[:i], self._cut(out.request_id, out.token_ids, out.logprobs, stop, k)]
            if out.finished:
                return outs[: i + 1]
        return outs

    def _cut(self, request_id, tokens, logprobs, stop: str, k: int = -1) -> StepOutput:
        self.stopped = stop
        return StepOutput(
            request_id, tuple(tokens[: k + 1]), tuple(logprobs[: k + 1]), "stop", stop
        )
