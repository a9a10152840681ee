"""The router's GenerateResponse chunks -> OpenAI response bodies.

    ResponseBuilder(kind="completion" | "chat", ...)
      .stream_chunk(chunk)      one streamed chunk (text_completion / chat.completion.chunk), or None
                                when the chunk adds nothing the client sees
      .role_chunk()             chat: the first chunk, {"delta": {"role": "assistant", "content": ""}}
      .usage_chunk(usage)       stream_options.include_usage: the last chunk, no choices
      .full(chunks)             the non-streamed text_completion / chat.completion

The last streamed chunk with a finish reason and the whole response carry "kv_handover"
(recomputed, reason, transfer_ms, streamed, stream_fallback) when the request went through a KV hand-over.

Text is the router's own streamed text (stop strings and incremental detokenization applied
once, in output.py), so both APIs and gRPC return the same characters. Logprobs: completions
give {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}; chat gives
{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}; a token's text is
its own bytes (tokenizer.token_bytes), decoded with replacement when it ends mid-character.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Literal

from splitserve.protos import generate_pb2
from splitserve.request.tokenizer import Tokenizer

FINISH = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


def _lp(value: float) -> float:
    """JSON has no -inf (a token the sampler's filters removed): vLLM's floor instead."""
    return value if math.isfinite(value) else -9999.0


def usage_json(u: generate_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def kv_handover_json(k: generate_pb2.KvHandover) -> dict[str, Any]:
    """splitserve's extension on the last chunk / the whole response (like vLLM's
    kv_transfer_params): whether the decode worker recomputed the prompt instead of pulling its
    KV, and why (README.md, "kv_handover"); whether it was streamed during the prefill, or why
    a stream fell back to the pull after it."""
    return {
        "recomputed": k.recomputed,
        "reason": k.reason,
        "transfer_ms": round(k.transfer_ms, 3),
        "streamed": k.streamed,
        "stream_fallback": k.stream_fallback,
    }


class ResponseBuilder:
    def __init__(
        self,
        kind: Literal["completion", "chat"],
        request_id: str,
        model: str,
        tokenizer: Tokenizer,
        want_logprobs: bool,
        include_usage: bool = False,
    ) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.created = int(time.time())
        self._offset = 0  # completions' text_offset: characters of token text so far
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    # ---- pieces ----------------------------------------------------------------------------------
    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._pieces:
            raw = self.tokenizer.token_bytes(token_id)
            self._pieces[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._pieces[token_id]

    def _logprobs(self, lps: Sequence[generate_pb2.TokenLogprob]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            content = []
            for lp in lps:
                text, raw = self._piece(lp.token_id)
                top = [
                    {
                        "token": self._piece(t.token_id)[0],
                        "logprob": _lp(t.logprob),
                        "bytes": self._piece(t.token_id)[1],
                    }
                    for t in lp.top_logprobs
                ]
                content.append(
                    {"token": text, "logprob": _lp(lp.logprob), "bytes": raw, "top_logprobs": top}
                )
            return {"content": content, "refusal": None}
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for lp in lps:
            text = self._piece(lp.token_id)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(_lp(lp.logprob))
            top = {self._piece(t.token_id)[0]: _lp(t.logprob) for t in lp.top_logprobs}
            top.setdefault(text, _lp(lp.logprob))  # OpenAI: the sampled token always, up to N+1
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out

    # ---- streaming -------------------------------------------------------------------------------
    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def role_chunk(self) -> dict[str, Any]:
        return self._envelope(
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def stream_chunk(self, chunk: generate_pb2.GenerateResponse) -> dict[str, Any] | None:
        finish = FINISH.get(chunk.finish_reason)
        lps = self._logprobs(chunk.logprobs) if chunk.logprobs else None
        if not chunk.text and finish is None and lps is None:
            return None
        if self.kind == "chat":
            delta = {"content": chunk.text} if chunk.text or finish is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": chunk.text, "logprobs": lps, "finish_reason": finish}
        body = self._envelope([choice])
        if finish is not None and chunk.HasField("kv_handover"):
            body["kv_handover"] = kv_handover_json(chunk.kv_handover)
        return body

    def usage_chunk(self, usage: generate_pb2.Usage) -> dict[str, Any]:
        body = self._envelope([])
        body["usage"] = usage_json(usage)
        return body

    # ---- whole response --------------------------------------------------------------------------
    def full(self, chunks: Sequence[generate_pb2.GenerateResponse]) -> dict[str, Any]:
        text = "".join(c.text for c in chunks)
        last = chunks[-1]
        lps = self._logprobs([lp for c in chunks for lp in c.logprobs])
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": lps,
                "finish_reason": FINISH.get(last.finish_reason),
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": lps,
                "finish_reason": FINISH.get(last.finish_reason),
            }
            obj = "text_completion"
        body = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_json(last.usage),
        }
        if last.HasField("kv_handover"):
            body["kv_handover"] = kv_handover_json(last.kv_handover)
        return body
