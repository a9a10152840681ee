"""The request fields both OpenAI endpoints take, and their conversion to SamplingParams.

Sampling (temperature, top_p, seed, penalties, stop, logit_bias), streaming options, and vLLM's
extensions (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...) are
declared once here for CompletionRequest and ChatCompletionRequest (openai_protocol.py). Only
JSON types, unsupported features and integers the proto cannot hold (logit_bias keys) are
checked; ranges are the gRPC path's own.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from splitserve.protos import generate_pb2
from splitserve.router import openai_structured as st
from splitserve.router.openai_errors import OpenAIError

U32 = 2**32 - 1
U64 = 2**64 - 1


class StrictModel(BaseModel):
    """A body part that refuses unknown parameters (a 400 naming them, via parse)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False


def unsupported(name: str, why: str):
    """A validator refusing field `name` unless it is absent or empty, saying `why`."""

    def check(cls, v):
        if v is not None and not (isinstance(v, (list, dict)) and not v):
            raise ValueError(f"{name} is not supported by this server ({why})")
        return v

    return field_validator(name)(classmethod(check))


class CommonParams(StrictModel):
    """The body fields both endpoints take; `_sampling` builds their SamplingParams."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, le=U64)
    stop: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    user: str | None = None  # an end-user id for the client's own bookkeeping; not used
    logit_bias: dict[str, float] | None = None  # {token id as a string: bias in [-100, 100]}
    # extensions, with vLLM's names
    top_k: int | None = Field(None, ge=-1, le=U32)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(None, ge=0, le=U32)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured output (openai_structured.py): OpenAI's, and vLLM's extension
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    # OpenAI platform fields SDK users set that change no token: taken where they ask for
    # nothing this server would have to do (no stored completions, one service tier)
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    service_tier: str | None = None

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("store = true is not supported: this server keeps no completions")
        return v

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, v: str | None) -> str | None:
        if v not in (None, "auto", "default"):
            raise ValueError(f"service_tier {v!r} is not offered; use auto or default")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            more = f"; send {v} requests (with different seeds) instead" if v > 1 else ""
            raise ValueError(f"n = {v} is not supported: one choice per request{more}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> str | list[str] | None:
        if (
            v is None
            or isinstance(v, str)
            or (isinstance(v, list) and all(isinstance(x, str) for x in v))
        ):
            return v
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        # JSON object keys are strings; OpenAI's are token ids. Ranges: the gRPC path's own.
        for key in v or ():
            if not (key.isascii() and key.isdigit() and int(key) <= U32):
                raise ValueError(
                    f"logit_bias key {key!r} is not a token id; use token ids as keys, "
                    'e.g. {"50256": -100}'
                )
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, v: list[int] | None) -> list[int] | None:
        bad = next((t for t in v or () if not 0 <= t <= U32), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is negative or too large")
        return v

    def _checks(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise OpenAIError.bad(
                "stream_options", "stream_options is only allowed with stream: true"
            )

    def _sampling(
        self, max_tokens: int | None, logprobs: int | None
    ) -> generate_pb2.SamplingParams:
        sp = generate_pb2.SamplingParams(
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
            stop_token_ids=self.stop_token_ids or [],
            min_tokens=self.min_tokens or 0,
            logit_bias={int(k): b for k, b in (self.logit_bias or {}).items()},
        )
        for name in (
            "temperature",
            "top_p",
            "seed",
            "repetition_penalty",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
        ):
            if (value := getattr(self, name)) is not None:
                setattr(sp, name, value)
        self._constrain(sp)
        if max_tokens is not None:
            sp.max_tokens = max_tokens
        if logprobs is not None:
            sp.logprobs = logprobs
        return sp

    def _constrain(self, sp: generate_pb2.SamplingParams) -> None:
        """At most one of response_format / structured_outputs sets the constraint."""
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, dict):
                raise OpenAIError.bad("structured_outputs", "structured_outputs must be an object")
            try:
                so = st.StructuredOutputs.model_validate(so)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in ("structured_outputs", *err["loc"]))
                raise OpenAIError.bad(where, f"{where}: {err['msg']}") from None
            if self.response_format not in (None, {"type": "text"}) and so.constraints():
                raise OpenAIError.bad(
                    "structured_outputs", "give response_format or structured_outputs, not both"
                )
        st.response_format_constraint(self.response_format, sp)
        st.structured_outputs_constraint(so, sp)

    def constraint_names(self) -> dict[str, str]:
        """The OpenAI parameter behind each proto constraint field (error messages)."""
        name = "structured_outputs" if self.structured_outputs is not None else "response_format"
        names = {k: name for k in ("json_schema", "json_object", "regex", "choice", "grammar")}
        return names | {"json_whitespace": "structured_outputs"}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
