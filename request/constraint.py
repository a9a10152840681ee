"""A structured-output constraint (JSON schema, any JSON object, regex, choice, Lark grammar)
and its llguidance grammar text.

Torch-free (layer 0): the router checks a constraint here without the model's tokenizer
(`check_constraint`: a compile, then `probe` with a byte-level one), so a bad schema is
INVALID_ARGUMENT before any worker is touched; the workers compile and probe it against their
tokenizer (request/grammar_cache.py). Every text is bounded before the engine sees it, and the
engine runs under `LIMITS`, which bound the work of building its lexer and of each mask step.

Why a probe: llguidance builds its lexer lazily, and its first mask walks the bytes the grammar
forces with the fuel left from the compile (`initial_lexer_fuel`), not a step's. A regex such as
`(a{1000}){1000}` compiles and validates, then burns that fuel (~0.4 s) in the first mask and
fails the next token ("lexer error: too many expressions constructed"). Computing the first mask
and following the grammar a few tokens at compile time (off the engine thread) finds that class
up front, and spends the compile's fuel there: a row's later masks get a step's fuel at most.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_CONSTRAINT_BYTES = 65536  # a schema / regex / grammar, as UTF-8
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
MAX_JSON_WHITESPACE = 4
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# llguidance's defaults, lowered: a grammar that needs more is refused with the engine's message
# rather than stalling a compile or a step. The documented speeds (~14k step fuel/ms) hold for
# plain grammars; a blown-up lexer (huge derivative expressions) ran at ~2-4k/ms on a CI core, so
# 100k step fuel cost ~45 ms a row. 20k: a bad row's step (the forced-bytes walk on what the last
# step left, then the mask on a fresh 20k) ~5-7 ms there; legit grammars (the benchmark schemas,
# 256-way enums and choices, 5000-char strings, a Lark grammar) walked 80 tokens with a 128k vocab
# and cold lexers at 10k without an error (5k failed some), so 20k keeps 2x. Items: fine at 5k.
LIMITS = dict(
    initial_lexer_fuel=500_000,
    step_lexer_fuel=20_000,
    step_max_items=10_000,
    max_lexer_states=100_000,
    max_grammar_size=200_000,
)
PROBE_STEPS = 4  # tokens `probe` follows (each a mask: ~1-2 ms at 128k tokens, at compile)
# how limit errors begin (llguidance's ParserError: the lexer's fuel / states, the parser's items)
LIMIT_ERRORS = ("lexer error:", "parser error:")


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS, verbose_errors=False)


class Constraint(BaseModel):
    """One constraint: `kind` and its text (`choices` for kind "choice")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    text: str = ""
    choices: tuple[str, ...] = ()
    json_whitespace: int = Field(0, ge=0, le=MAX_JSON_WHITESPACE)

    @model_validator(mode="after")
    def _bounded(self) -> Constraint:
        if len(self.text.encode()) > MAX_CONSTRAINT_BYTES:
            raise ValueError(
                f"the {self.kind} is {len(self.text.encode())} bytes; send at most "
                f"{MAX_CONSTRAINT_BYTES}"
            )
        if self.kind in ("json_schema", "regex", "grammar") and not self.text:
            raise ValueError(f"the {self.kind} is empty; send one, or no constraint")
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES:
                raise ValueError(
                    f"choice needs 1 to {MAX_CHOICES} strings, got {len(self.choices)}"
                )
            bad = [i for i, c in enumerate(self.choices) if not 0 < len(c) <= MAX_CHOICE_CHARS]
            if bad:
                raise ValueError(
                    f"choice[{bad[0]}] is empty or over {MAX_CHOICE_CHARS} characters; "
                    f"send non-empty choices of at most {MAX_CHOICE_CHARS} characters"
                )
        elif self.choices:
            raise ValueError("choices belong to kind 'choice' only")
        return self

    @property
    def key(self) -> str:
        """What identifies the compiled grammar (the compile cache's key)."""
        return self.grammar()

    def grammar(self) -> str:
        """The llguidance grammar (JSON text) of this constraint; raises ValueError for JSON
        that does not parse."""
        if self.kind in ("json_schema", "json_object"):
            if self.kind == "json_object":
                schema: object = {"type": "object"}
            else:
                try:
                    schema = json.loads(self.text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"the json_schema is not valid JSON: {exc}") from None
                except RecursionError:  # deeper than the interpreter's recursion limit
                    raise ValueError(
                        "the json_schema nests too deeply to parse (the grammar engine takes about "
                        "120 levels at most)"
                    ) from None
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("the json_schema must be a JSON object (or true / false)")
            # no free whitespace by default; `json_whitespace` allows a small bound
            opts: dict = {"whitespace_flexible": False}
            if self.json_whitespace:
                opts["whitespace_pattern"] = f"[\\x20\\x0A]{{0,{self.json_whitespace}}}"
            # overrides: a schema's own "x-guidance" cannot turn free whitespace back on
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=opts)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":  # JSON string literals are Lark string literals
            lark = "start: " + " | ".join(json.dumps(c) for c in self.choices)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.LLMatcher.grammar_from_lark(self.text)


def engine_message(error: str) -> str:
    """The grammar engine's error, one line, without its `<non-verbose/>` marker."""
    return " ".join(error.replace("<non-verbose/>", " ").split())


def is_limit_error(error: str) -> bool:
    """True when a matcher's error is one of the engine's limits (not a refused token)."""
    return engine_message(error).startswith(LIMIT_ERRORS)  # (a refused token: "Parser Error")


def limits_exceeded(n: int, error: str) -> str:
    """The message of a request whose constraint hit a limit at its n-th output token."""
    return (
        f"the constraint exceeded the grammar engine's limits at output token {n}: "
        f"{engine_message(error)}; send a simpler constraint (retrying fails the same way)"
    )


def lowest_allowed(mask: bytes, eos: Sequence[int]) -> int | None:
    """The smallest token a bitmask (llguidance's `compute_bitmask`) allows, EOS aside."""
    bits = int.from_bytes(mask, "little")
    for e in eos:
        bits &= ~(1 << e)
    return (bits & -bits).bit_length() - 1 if bits else None


def probe(matcher: llguidance.LLMatcher, eos: Sequence[int], steps: int = PROBE_STEPS) -> str:
    """'' when a freshly compiled `matcher` computes its first mask and follows the smallest
    allowed token for `steps` tokens within the limits, else the engine's message. It walks a
    copy: the matcher stays at token 0, but its lexer (shared by every copy) is built and its
    compile fuel spent. Blocking, with the GIL released in the masks: call it off the loop."""
    if matcher.is_error():
        return engine_message(matcher.get_error())
    walker = matcher.deep_copy()
    for _ in range(steps):
        token = lowest_allowed(walker.compute_bitmask(), eos)
        if walker.is_error() or token is None or not walker.consume_token(token):
            break
    return engine_message(walker.get_error()) if walker.is_error() else ""


class _ByteTokens:  # the router's stand-in tokenizer: one token per byte, and EOS
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"\xff[EOS]"]

    def __call__(self, s: str | bytes) -> list[int]:
        return list(s if isinstance(s, bytes) else s.encode())


_BYTE_TOKENIZER: llguidance.LLTokenizer | None = None
_VERDICTS: OrderedDict[tuple, str] = OrderedDict()  # (grammar digest, LIMITS) -> error or ''
_VERDICTS_MAX = 512
_lock = threading.Lock()


def _byte_tokenizer() -> llguidance.LLTokenizer:
    global _BYTE_TOKENIZER
    with _lock:
        if _BYTE_TOKENIZER is None:
            _BYTE_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))
        return _BYTE_TOKENIZER


def _verdict(grammar: str) -> str:
    """The engine's error for `grammar` ('' when fine): validated, then probed with byte tokens
    (the forced-bytes walk does not depend on the vocabulary). Remembered per grammar text, so
    a schema that every request repeats is checked once."""
    key = (hashlib.sha256(grammar.encode()).digest(), tuple(sorted(LIMITS.items())))
    with _lock:
        if key in _VERDICTS:
            _VERDICTS.move_to_end(key)
            return _VERDICTS[key]
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits()).strip()
    if error:
        error = f"does not compile: {error}"
    else:
        tok = _byte_tokenizer()
        m = llguidance.LLMatcher(tok, grammar, limits=parser_limits(), log_level=0)
        if found := probe(m, [tok.eos_token]):
            error = f"exceeds the grammar engine's limits: {found}"
    with _lock:
        _VERDICTS[key] = error
        while len(_VERDICTS) > _VERDICTS_MAX:
            _VERDICTS.popitem(last=False)
    return error


def check_constraint(c: Constraint) -> None:
    """Raises ValueError with the grammar engine's message when `c` cannot compile, or fails
    within its first tokens under `LIMITS` (checked without the model's tokenizer: what fails
    here fails on every model)."""
    if error := _verdict(c.grammar()):
        raise ValueError(f"the {c.kind} {error}")
