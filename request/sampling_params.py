"""Per-request sampling parameters, with vLLM's names and meanings.

One frozen pydantic model: a bad value fails when the request is built (router or CLI),
before any KV block is allocated, with an error naming the field. What needs the model
(vocab size) is checked separately by `validate_against_vocab`, once the worker knows it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from splitserve.request.constraint import Constraint

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's bound); the device keeps a table this wide
MAX_STOP_TOKEN_IDS = 64  # min_tokens bans them on the device, in a table this wide
# Hard caps on stop strings, what any service takes (the router's limits are lower and
# configurable, router/config.py): matching costs O(total stop length) per request to build
# and O(new text) per token (stop_strings.py), so both stay bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
LOGIT_BIAS_RANGE = 100.0  # OpenAI: a bias is in [-100, 100]
_UINT64_MAX = 2**64 - 1  # the wire type of `seed` (generate.proto)
_StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class SamplingParams(BaseModel):
    """How to pick each generated token (vLLM semantics).

    - `temperature` 0 is greedy; `top_k` 0 or -1 disables top-k, 1 is greedy.
    - penalties follow vLLM: `repetition_penalty` over prompt and output tokens
      (divides positive logits, multiplies negative ones), `presence_penalty` /
      `frequency_penalty` over output tokens only (subtracted from the logits).
    - `seed` makes the request's tokens a function of its logits, seed and step only, so the
      same alone or in any batch; under bf16 the logits themselves can differ in a last bit by
      batch size, so there it holds up to that rounding (see sampler.py, docs/sampling.md).
    - `logprobs` n: return the sampled token's logprob plus the n most likely tokens.
    - `logit_bias` {token id: bias in [-100, 100]} is added to the raw logits (OpenAI);
      `min_tokens` bans EOS and `stop_token_ids` (and stops no request) before that many
      tokens were generated (vLLM).
    - `constraint` (structured output, request/constraint.py): every token is masked to what
      the constraint still allows; it excludes `min_tokens` and `ignore_eos`, since the end of
      the constraint is the one place EOS is allowed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = 0
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=_UINT64_MAX)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    stop: tuple[_StopString, ...] = Field((), max_length=MAX_STOP_STRINGS)
    stop_token_ids: tuple[Annotated[int, Field(ge=0)], ...] = Field(
        (), max_length=MAX_STOP_TOKEN_IDS
    )
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    min_tokens: int = Field(0, ge=0)
    # {token id: bias} on input; kept as sorted (id, bias) pairs so the params stay hashable
    logit_bias: tuple[tuple[Annotated[int, Field(ge=0)], float], ...] = Field(
        (), max_length=MAX_LOGIT_BIAS
    )
    constraint: Constraint | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, v: Any) -> Any:
        # vLLM (and the OpenAI API) accept a single string as well as a list.
        return (v,) if isinstance(v, str) else v

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"must be 0 or -1 (disabled) or at least 1, got {v}")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_pairs(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return tuple(sorted(v.items(), key=lambda kv: int(kv[0])))
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        bad = {t: b for t, b in v if not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE}
        if bad:
            raise ValueError(f"biases must be finite and in [-100, 100], got {bad}")
        if len({t for t, _ in v}) != len(v):
            raise ValueError("a token id appears twice in logit_bias")
        return v

    @model_validator(mode="after")
    def _min_tokens_within_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self

    @model_validator(mode="after")
    def _constraint_owns_eos(self) -> SamplingParams:
        if self.constraint is not None and (self.min_tokens or self.ignore_eos):
            raise ValueError(
                "a constraint ends the output with EOS when it is complete, so it cannot be "
                "combined with min_tokens or ignore_eos; drop those"
            )
        return self

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: no randomness, so `seed` and the filters do not matter."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax of the raw logits, nothing else asked: the decode step's greedy graph."""
        return (
            self.is_greedy
            and not self.needs_penalties
            and self.logprobs is None
            and not self.logit_bias
            and self.min_tokens == 0
            and self.constraint is None
        )


def validate_against_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Refuse token ids the model cannot produce (a stop token that could never match is
    almost certainly a tokenizer / model mix-up, so it is an error rather than ignored)."""
    bad_bias = sorted(t for t, _ in params.logit_bias if t >= vocab_size)
    if bad_bias:
        raise ValueError(
            f"logit_bias names token ids {bad_bias[:8]} outside the model's vocabulary "
            f"(size {vocab_size}); use ids below {vocab_size}"
        )
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(
            f"stop_token_ids {bad[:8]} are outside the model's vocabulary (size {vocab_size}); "
            f"use ids below {vocab_size}"
        )
