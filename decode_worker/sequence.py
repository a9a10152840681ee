"""One request's state on the decode worker, and the typed messages to and from the engine.

Token accounting (P = prompt length, out = output_token_ids, first_token_id = out[0]):

    decode step k (k = 0, 1, ...) feeds out[k] at position P + k and produces out[k+1]
    KV present before step k: P + k positions; step k needs ceil((P + k + 1) / block_size) blocks

With overlap, a step's tokens reach the host one step late, so `in_flight` counts the
launched steps whose token has not been read yet; the next step's index is
`len(out) - 1 + in_flight`. Length limits (max_tokens, max_model_len) are decided from that
count before launching, so a sequence never runs a step past them; only eos / stop tokens are
found after the fact (one wasted lane-step at most). Stop strings are matched off the engine
thread (stop_strings.py), whose match aborts the sequence a step or two later.

Colocated (no prefill happened, `first_token_id` None): the sequence starts with empty `out`.
After admission the engine computes the prompt (the recompute path: positions 0..P-1), in
chunks over as many engine steps as the chunk budget needs (`prefill_pos` tracks it), and
samples out[0] on the host from the last prompt position's logits; it then runs step 0 in
the engine step of its last chunk, like a handed-off sequence. Until then
`needs_first_token` is true.
"""

from __future__ import annotations

import enum
import itertools
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from splitserve.engine.sampler import TokenLogprobs
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.stop_checker import StopChecker


class Status(enum.Enum):
    WAITING = "waiting"  # queued; KV present (admitted with blocks) or to be recomputed
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class DecodeInput:
    """What the servicer hands the engine (validated already)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    first_token_id: int | None  # None: no prefill happened; the engine samples it (colocated)
    params: SamplingParams
    matcher: object | None = None  # structured output: the compiled constraint, at token 0


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Tokens of one request produced since its last output; the last one has finish_reason.

    finish_reason: "stop" | "length" | "abort" | "error" (error: `error` says why)."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: Exception | None = None
    # the sequence's first output only: (admitted into a running batch, this token produced),
    # engine-thread time.monotonic(); the servicer reports the decode queue and a colocated
    # request's own prefill from it (worker.proto admit_wait_ms, local_prefill_ms)
    started: tuple[float, float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


Sink = Callable[[StepOutput], None]
_UIDS = itertools.count(1)
# seeds the grammar-state fingerprints, so no client can aim two token sequences at one value
_GRAMMAR_SALT = secrets.randbits(64)


@dataclass(eq=False)
class DecodeSequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: StopChecker
    sink: Sink
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    in_flight: int = 0  # launched steps whose token is not read yet
    admit_order: int = 0  # larger = admitted later; preemption takes the largest
    num_preemptions: int = 0
    last_token_time: float = field(default_factory=time.monotonic)
    admitted_at: float = 0.0  # time.monotonic() of its first admission into a running batch
    started_reported: bool = False  # its first output carried `StepOutput.started`
    uid: int = field(default_factory=lambda: next(_UIDS))  # never reused (id() is)
    # structured output: advanced with every accepted token, so it always stands after the
    # last token of output_token_ids (kept across preemption and recompute)
    matcher: object | None = None
    # (its constraint, the tokens its matcher consumed) hashed: rows with equal fingerprints
    # (token_masks.py checks their tokens too) share one mask fill
    grammar_fp: int = 0
    # local prefill in progress (admitted without KV): the next recompute_tokens() index whose
    # KV is still to be computed; None when no local prefill is pending (chunked prefill:
    # a long prompt is computed over several engine steps while the others keep decoding)
    prefill_pos: int | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def next_step(self) -> int:
        """Index k of the next step to launch (see module doc)."""
        return len(self.output_token_ids) - 1 + self.in_flight

    def start_grammar(self, matcher: object | None) -> None:
        """The request's own compiled constraint, at token 0 (None: unconstrained)."""
        self.matcher = matcher
        if matcher is not None:
            # (the frozen Constraint's own hash: .key would rebuild its grammar text)
            self.grammar_fp = hash((_GRAMMAR_SALT, self.params.constraint))

    def advance_matcher(self, token: int) -> bool:
        """The matcher consumes `token` (out[-1]); False when the constraint refuses it."""
        self.grammar_fp = hash((self.grammar_fp, token))
        return self.matcher.consume_token(token)

    @property
    def next_position(self) -> int:
        return self.prompt_len + self.next_step

    @property
    def needs_first_token(self) -> bool:
        """No prefill happened yet: admission computes the prompt and samples out[0]."""
        return not self.output_token_ids

    @property
    def admit_position(self) -> int:
        """The position the first step after admission writes (P when out[0] is still to be sampled)."""
        return self.prompt_len if self.needs_first_token else self.next_position

    @property
    def has_kv(self) -> bool:
        return bool(self.block_ids)

    @property
    def prefilling(self) -> bool:
        """Admitted, its local prefill not finished: it holds blocks but does not step yet."""
        return self.prefill_pos is not None

    def may_step(self, max_tokens_cap: int, max_model_len: int) -> bool:
        """Whether one more step stays within max_tokens and max_model_len (decided from
        counts, before the in-flight tokens are read)."""
        produced = len(self.output_token_ids) + self.in_flight
        return produced < max_tokens_cap and self.prompt_len + produced < max_model_len

    def recompute_tokens(self) -> list[int]:
        """Tokens whose KV a local prefill must rebuild: all but the last known token, which
        the next decode step feeds (the whole prompt when out[0] is still to be sampled)."""
        return self.prompt_token_ids + self.output_token_ids[:-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
