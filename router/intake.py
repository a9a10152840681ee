"""A GenerateRequest becomes a PreparedRequest, or a RequestError, before any worker is touched.

Checks, in order, the cheap ones before the prompt is tokenized: message size, request id,
stop strings (the router's max_stop_strings / max_stop_string_chars), prompt (set, non-empty,
text within max_prompt_bytes, ids in the vocabulary, room for one new token within
max_model_len), sampling parameters (the shared `proto_convert` rules: max_tokens must fit in
max_model_len after the prompt). The router learns vocab size, max_model_len and eos ids from the
model folder (config.json, tokenizer.json) and its own config; no weights are read.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from splitserve.config.hf_config import load_model_config
from splitserve.protos import generate_pb2
from splitserve.request.errors import RequestError
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.tokenizer import Tokenizer
from splitserve.router.config import RouterConfig
from splitserve.service.proto_convert import (
    check_sampling_constraint,
    check_stop_strings,
    sampling_params_from_proto,
    validate_prompt,
)

_TOKENIZE_IN_THREAD = 32_768  # characters; longer texts are tokenized off the event loop


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Tokenizer

    @classmethod
    def load(cls, cfg: RouterConfig) -> ModelInfo:
        model = load_model_config(cfg.model_path)
        max_len = cfg.max_model_len or model.max_position_embeddings
        if max_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                f"({model.max_position_embeddings}); lower --max-model-len"
            )
        tokenizer = Tokenizer.from_dir(cfg.model_path)
        return cls(
            cfg.model_name or Path(cfg.model_path).resolve().name,
            model.vocab_size,
            max_len,
            tuple(model.eos_token_ids),
            tokenizer,
        )


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str  # what the workers see: the caller's id + '#' + a random suffix
    prompt: list[int]
    params: SamplingParams
    sampling: generate_pb2.SamplingParams  # what the workers get: max_tokens resolved
    skip_special_tokens: bool
    client_request_id: str = ""  # the caller's own id (responses carry it); '': request_id

    @property
    def want_logprobs(self) -> bool:
        return self.params.logprobs is not None


def worker_request_id(client_id: str) -> str:
    """Unique across callers (two may send the same id), with the caller's id kept at the front
    so logs and prefix matches on it still find the request."""
    return f"{client_id}#{secrets.token_hex(6)}"


def _request_id(request: generate_pb2.GenerateRequest, cfg: RouterConfig) -> str:
    rid = request.request_id
    if not rid:
        return uuid.uuid4().hex
    if len(rid) > cfg.max_request_id_len or not rid.isprintable():
        raise RequestError.invalid(
            f"request_id must be at most {cfg.max_request_id_len} printable characters; "
            "use a shorter id, or leave it empty for the router to assign one"
        )
    return rid


def prompt_too_big(texts: Sequence[str], limit: int) -> int | None:
    """The UTF-8 size of `texts` together when it is over `limit` bytes, else None; counted
    before anything is tokenized (and without encoding when it is clearly within the limit)."""
    if 4 * sum(map(len, texts)) <= limit:  # UTF-8 takes at most 4 bytes a character
        return None
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return size if size > limit else None


async def _prompt(
    request: generate_pb2.GenerateRequest, model: ModelInfo, cfg: RouterConfig
) -> tuple[list[int], str]:
    which = request.WhichOneof("prompt")
    if which is None:
        raise RequestError.invalid(
            "prompt is not set; send prompt text in `text` or token ids in `token_ids`"
        )
    if which == "token_ids":
        return list(request.token_ids.ids), "token_ids.ids"
    text = request.text
    if not text:
        raise RequestError.invalid("text is empty; send a non-empty prompt")
    if (size := prompt_too_big([text], cfg.max_prompt_bytes)) is not None:
        raise RequestError.invalid(
            f"text is {size} bytes, over this router's limit of {cfg.max_prompt_bytes} bytes of "
            f"prompt text (max_prompt_bytes); send a shorter prompt (at most "
            f"{model.max_model_len - 1} tokens fit anyway)"
        )
    if len(text) > _TOKENIZE_IN_THREAD:
        return await asyncio.to_thread(model.tokenizer.encode, text), "text"
    return model.tokenizer.encode(text), "text"


async def prepare(
    request: generate_pb2.GenerateRequest, model: ModelInfo, cfg: RouterConfig
) -> PreparedRequest:
    size = request.ByteSize()
    if size > cfg.max_request_bytes:
        raise RequestError.invalid(
            f"the request is {size} bytes, over this router's limit of {cfg.max_request_bytes} bytes; send a "
            f"shorter prompt (at most {model.max_model_len - 1} tokens fit anyway) or raise max_request_bytes"
        )
    rid = _request_id(request, cfg)
    msg = request.sampling if request.HasField("sampling") else None
    if msg is not None:
        check_stop_strings(
            msg.stop,
            cfg.max_stop_strings,
            cfg.max_stop_string_chars,
            settings=("max_stop_strings", "max_stop_string_chars"),
        )
    prompt, field = await _prompt(request, model, cfg)
    validate_prompt(prompt, model.vocab_size, model.max_model_len, field=field)
    params = sampling_params_from_proto(
        msg, prompt_len=len(prompt), max_model_len=model.max_model_len, vocab_size=model.vocab_size
    )
    if params.constraint is not None:  # the grammar engine's check, off the event loop
        await asyncio.to_thread(check_sampling_constraint, params)
    sampling = generate_pb2.SamplingParams()
    if msg is not None:
        sampling.CopyFrom(msg)
    sampling.max_tokens = params.max_tokens  # the workers may not share the router's default
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return PreparedRequest(worker_request_id(rid), prompt, params, sampling, skip, rid)
