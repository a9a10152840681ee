"""Turns one request's generated token ids into the chunks the client sees.

The workers stream token ids; the router owns the text: incremental detokenization and stop
strings (the prefill worker checks eos / stop tokens / max_tokens for the first token, but
not stop strings, so the first token goes through the same checks as every other). Each
token runs through, in order,

    IncrementalDetokenizer.add  ->  StopChecker.update  ->  text delta, maybe a finish reason

exactly as the single-process engine (engine/offline.py) does, so the streamed text
concatenates to the offline text. When a worker ends the request for a reason the router's
checker did not see (its own limits, an abort), `end` releases the held-back text.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.protos import generate_pb2
from splitserve.request.detokenizer import IncrementalDetokenizer
from splitserve.request.stop_checker import StopChecker
from splitserve.router.intake import ModelInfo, PreparedRequest
from splitserve.service.proto_convert import finish_reason_to_proto, stop_reason_to_proto


class OutputStream:
    def __init__(self, model: ModelInfo, req: PreparedRequest) -> None:
        self.request_id = req.client_request_id or req.request_id  # the caller's id
        self.prompt_tokens = len(req.prompt)
        self.want_logprobs = req.want_logprobs
        self.detok = IncrementalDetokenizer(model.tokenizer, req.prompt, req.skip_special_tokens)
        self.stop = StopChecker(
            req.params, model.eos_token_ids, model.max_model_len, len(req.prompt)
        )
        self.cached_prompt_tokens = 0
        self.num_tokens = 0  # tokens streamed (or about to be)
        self.finish_reason = generate_pb2.FINISH_REASON_UNSPECIFIED

    @property
    def finished(self) -> bool:
        return self.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED

    def add(
        self, token_ids: Sequence[int], logprobs: Sequence[generate_pb2.TokenLogprob] = ()
    ) -> generate_pb2.GenerateResponse:
        """A chunk for the tokens, up to and including the one that finishes the request
        (later ones are dropped)."""
        if self.finished:
            raise RuntimeError(f"{self.request_id}: tokens after the request finished")
        chunk = generate_pb2.GenerateResponse(request_id=self.request_id)
        text: list[str] = []
        for i, token in enumerate(token_ids):
            result = self.stop.update(token, self.detok.add(token))
            self.num_tokens += 1
            chunk.token_ids.append(token)
            if self.want_logprobs and i < len(logprobs):
                chunk.logprobs.append(logprobs[i])
            text.append(result.text)
            if result.finished:
                if result.finish_reason == "length":
                    text.append(
                        self.detok.flush()
                    )  # an unfinished character shows as in a full decode
                self._finish(
                    chunk,
                    finish_reason_to_proto(result.finish_reason),
                    stop_reason_to_proto(result.stop_reason),
                )
                break
        chunk.text = "".join(text)
        return chunk

    def end(
        self,
        chunk: generate_pb2.GenerateResponse | None,
        reason: int,
        stop_reason: generate_pb2.StopReason | None = None,
    ) -> generate_pb2.GenerateResponse:
        """Finishes with a reason decided elsewhere (a worker, an abort): the held-back text is
        released into `chunk` (or a new empty chunk), which becomes the last one."""
        chunk = chunk or generate_pb2.GenerateResponse(request_id=self.request_id)
        chunk.text += self.stop.end()
        if reason != generate_pb2.FINISH_REASON_STOP:
            chunk.text += self.detok.flush()
        self._finish(chunk, reason, stop_reason)
        return chunk

    def _finish(
        self,
        chunk: generate_pb2.GenerateResponse,
        reason: int,
        stop_reason: generate_pb2.StopReason | None,
    ) -> None:
        self.finish_reason = reason
        chunk.finish_reason = reason
        if stop_reason is not None:
            chunk.stop_reason.CopyFrom(stop_reason)
        chunk.usage.CopyFrom(
            generate_pb2.Usage(
                prompt_tokens=self.prompt_tokens,
                cached_prompt_tokens=self.cached_prompt_tokens,
                completion_tokens=self.num_tokens,
            )
        )
