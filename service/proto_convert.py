"""Between the wire (generate.proto / worker.proto) and the engine's types.

Inbound, everything is validated before any allocation; a bad value raises
`RequestError(INVALID_ARGUMENT, ...)` whose message names the field and says how to fix it.
Outbound, engine results become proto messages. Shared by the workers and the router.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import ValidationError

from splitserve.protos import generate_pb2
from splitserve.request.constraint import MAX_JSON_WHITESPACE, Constraint, check_constraint
from splitserve.request.errors import RequestError
from splitserve.request.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    validate_against_vocab,
)

if (
    TYPE_CHECKING
):  # the sampler imports torch, which the router (a user of this module) does not need
    from splitserve.engine.sampler import TokenLogprobs

# How to fix each sampling field, appended to pydantic's description of what is wrong.
_HINTS = {
    "max_tokens": "use at least 1, or leave it unset to generate up to max_model_len",
    "temperature": "use a finite value >= 0 (0 is greedy), or leave it unset for 1.0",
    "top_p": "use a value in (0, 1]; 1 (or unset) turns nucleus sampling off",
    "top_k": "use 0 (off) or at least 1",
    "min_p": "use a value in [0, 1]; 0 turns it off",
    "seed": "use an integer in [0, 2^64)",
    "repetition_penalty": "use a finite value > 0; 1 (or unset) turns it off",
    "presence_penalty": "use a value in [-2, 2]; 0 turns it off",
    "frequency_penalty": "use a value in [-2, 2]; 0 turns it off",
    "stop": "drop empty stop strings",
    "logprobs": f"ask for at most {MAX_LOGPROBS} alternatives, or leave it unset",
    "stop_token_ids": f"send at most {MAX_STOP_TOKEN_IDS} stop token ids",
    "min_tokens": "use at most max_tokens; 0 turns it off",
    "logit_bias": f"send at most {MAX_LOGIT_BIAS} entries, each bias in [-100, 100]",
    "constraint": "set at most one constraint, within its bounds (docs/structured_output.md)",
}
_OPTIONAL = ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty", "logprobs")
_PLAIN = (
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
)

_FINISH = {
    None: generate_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
}


def validate_prompt(
    token_ids: Sequence[int], vocab_size: int, max_model_len: int, field: str = "prompt_token_ids"
) -> None:
    """A prompt the model can take: non-empty, ids in the vocabulary, room for one new token."""
    if not token_ids:
        raise RequestError.invalid(f"{field} is empty; send at least one token")
    bad = next((i for i, t in enumerate(token_ids) if t >= vocab_size or t < 0), None)
    if bad is not None:
        raise RequestError.invalid(
            f"{field}[{bad}] = {token_ids[bad]} is outside the model's vocabulary (size {vocab_size}); "
            "tokenize with this model's tokenizer"
        )
    if len(token_ids) >= max_model_len:
        raise RequestError.invalid(
            f"{field} has {len(token_ids)} tokens but max_model_len is {max_model_len} (prompt plus at "
            f"least one generated token must fit); shorten the prompt to at most {max_model_len - 1} tokens"
        )


def _shown(value: object, limit: int = 80) -> str:
    """A refused value as the error repeats it: a 100k-id list would make the status too big
    to deliver (gRPC's metadata limit)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sampling_params_from_proto(
    msg: generate_pb2.SamplingParams | None,
    *,
    prompt_len: int,
    max_model_len: int,
    vocab_size: int,
    field: str = "sampling",
) -> SamplingParams:
    """proto SamplingParams -> engine SamplingParams. Unset max_tokens means "up to
    max_model_len", as generate.proto documents (not the engine's default of 16); a max_tokens
    that does not fit after the prompt is refused, never clamped (vLLM answers 400 too)."""
    msg = msg if msg is not None else generate_pb2.SamplingParams()
    values: dict = {name: getattr(msg, name) for name in _PLAIN}
    values |= {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    room = max_model_len - prompt_len
    values.setdefault("max_tokens", max(1, room))
    if values["max_tokens"] > room >= 1:
        raise RequestError.invalid(
            f"{field}.max_tokens = {values['max_tokens']} does not fit: the prompt has {prompt_len} "
            f"tokens and max_model_len is {max_model_len}, which leaves {room} to generate; ask for "
            f"at most {room}, or leave it unset to generate up to max_model_len"
        )
    check_stop_strings(msg.stop, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, field)
    values["stop"] = tuple(msg.stop)
    values["stop_token_ids"] = tuple(msg.stop_token_ids)
    values["logit_bias"] = _logit_bias(msg, field)
    values["constraint"] = constraint_from_proto(msg, field)
    if 1 <= values["max_tokens"] < values["min_tokens"]:  # (max_tokens 0: pydantic names it)
        limit = "max_tokens" if msg.HasField("max_tokens") else "what fits in max_model_len"
        raise RequestError.invalid(
            f"{field}.min_tokens = {values['min_tokens']} is more than the "
            f"{values['max_tokens']} tokens the request may generate ({limit}); "
            "lower min_tokens or raise max_tokens"
        )
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if name in values and not math.isfinite(
            values[name]
        ):  # say it plainly; pydantic says "finite number"
            raise RequestError.invalid(f"{field}.{name} is {values[name]}; {_HINTS[name]}")
    try:
        params = SamplingParams(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        if not err["loc"]:  # a check across fields names them in its message
            raise RequestError.invalid(
                f"{field}: {err['msg'].removeprefix('Value error, ')}"
            ) from None
        name = str(err["loc"][0])
        where = ".".join(str(p) for p in (field, *err["loc"]))
        hint = f"; {_HINTS[name]}" if name in _HINTS else ""
        raise RequestError.invalid(
            f"{where} = {_shown(err.get('input'))}: {err['msg']}{hint}"
        ) from None
    try:
        validate_against_vocab(params, vocab_size)
    except ValueError as exc:
        raise RequestError.invalid(f"{field}.{exc}") from None
    return params


def constraint_from_proto(msg: generate_pb2.SamplingParams, field: str) -> Constraint | None:
    """The `constraint` oneof, bounded; its grammar is checked later (`check_sampling_constraint`)."""
    kind = msg.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not msg.json_object):
        if msg.json_whitespace:
            raise RequestError.invalid(
                f"{field}.json_whitespace is set without a JSON constraint; drop it or set "
                "json_schema / json_object"
            )
        return None
    if msg.json_whitespace > MAX_JSON_WHITESPACE:
        raise RequestError.invalid(
            f"{field}.json_whitespace = {msg.json_whitespace}; use 0 to {MAX_JSON_WHITESPACE}"
        )
    if msg.json_whitespace and kind not in ("json_schema", "json_object"):
        raise RequestError.invalid(f"{field}.json_whitespace applies to JSON constraints only")
    try:
        if kind == "choice":
            return Constraint(kind="choice", choices=tuple(msg.choice.choices))
        text = "" if kind == "json_object" else getattr(msg, kind)
        return Constraint(kind=kind, text=text, json_whitespace=msg.json_whitespace)
    except ValidationError as exc:
        why = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise RequestError.invalid(f"{field}.{kind}: {why}") from None


def check_sampling_constraint(params: SamplingParams, field: str = "sampling") -> None:
    """INVALID_ARGUMENT with the grammar engine's message when the constraint cannot compile
    (no tokenizer needed; the router runs it off its event loop)."""
    if params.constraint is None:
        return
    try:
        check_constraint(params.constraint)
    except ValueError as exc:
        raise RequestError.invalid(f"{field}.{params.constraint.kind}: {exc}") from None


def check_stop_strings(
    stop: Sequence[str],
    max_strings: int,
    max_chars: int,
    field: str = "sampling",
    settings: tuple[str, str] | None = None,
) -> None:
    """At most `max_strings` stop strings of at most `max_chars` characters each; `settings`
    names the config keys that set the two limits (the router's), for the message."""
    count_key, chars_key = (f" ({k})" for k in settings) if settings else ("", "")
    if len(stop) > max_strings:
        raise RequestError.invalid(
            f"{field}.stop has {len(stop)} strings, over this server's limit of {max_strings}"
            f"{count_key}; send at most {max_strings} stop strings"
        )
    for i, text in enumerate(stop):
        if len(text) > max_chars:
            raise RequestError.invalid(
                f"{field}.stop[{i}] is {len(text)} characters long, over this server's limit of "
                f"{max_chars}{chars_key}; use stop strings of at most {max_chars} characters"
            )


def _logit_bias(msg: generate_pb2.SamplingParams, field: str) -> dict[int, float]:
    """The map, checked with plain messages (pydantic would print the whole table)."""
    bias = dict(msg.logit_bias)
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError.invalid(
            f"{field}.logit_bias has {len(bias)} entries; send at most {MAX_LOGIT_BIAS}"
        )
    for token, value in sorted(bias.items()):
        if not math.isfinite(value):
            raise RequestError.invalid(
                f"{field}.logit_bias[{token}] is {value}; use a finite bias in [-100, 100]"
            )
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise RequestError.invalid(
                f"{field}.logit_bias[{token}] = {value:g} is outside [-100, 100]; use a bias in "
                "[-100, 100] (-100 all but bans the token, 100 all but forces it)"
            )
    return bias


def validate_request(
    prompt_token_ids: Sequence[int],
    sampling: generate_pb2.SamplingParams | None,
    *,
    vocab_size: int,
    max_model_len: int,
) -> SamplingParams:
    """The checks every service runs on a request before allocating anything."""
    validate_prompt(prompt_token_ids, vocab_size, max_model_len)
    return sampling_params_from_proto(
        sampling,
        prompt_len=len(prompt_token_ids),
        max_model_len=max_model_len,
        vocab_size=vocab_size,
    )


def logprob_to_proto(lp: TokenLogprobs) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_logprobs=[generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def finish_reason_to_proto(reason: str | None) -> int:
    try:
        return _FINISH[reason]
    except KeyError:
        raise ValueError(
            f"unknown finish reason {reason!r}; expected one of {sorted(map(str, _FINISH))}"
        ) from None


def stop_reason_to_proto(reason: str | int | None) -> generate_pb2.StopReason | None:
    """A matched stop string or stop token id; None for EOS and non-stop endings."""
    if reason is None:
        return None
    if isinstance(reason, str):
        return generate_pb2.StopReason(stop_str=reason)
    return generate_pb2.StopReason(stop_token_id=reason)
