"""A structured-output constraint (JSON schema, any JSON object, regex, choice, Lark grammar)
and its llguidance grammar text.

Torch-free (layer 0): the router checks a constraint here with the grammar engine and no
tokenizer (`check_constraint`), so a bad schema is INVALID_ARGUMENT before any worker is
touched; the workers compile it against their tokenizer (request/grammar_cache.py). Every text
is bounded before the engine sees it, and the engine runs under `LIMITS`, which bound the
work of building its lexer and of each mask step.
"""

from __future__ import annotations

import json
from typing import Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_CONSTRAINT_BYTES = 65536  # a schema / regex / grammar, as UTF-8
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
MAX_JSON_WHITESPACE = 4
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# llguidance's defaults, lowered: a grammar that needs more is refused with the engine's message
# rather than stalling the compile (initial fuel ~50k/ms: <= ~10 ms of lexer building) or a
# step (step fuel ~14k/ms, items ~20k/ms: a few ms at most per row).
LIMITS = dict(
    initial_lexer_fuel=500_000,
    step_lexer_fuel=100_000,
    step_max_items=50_000,
    max_lexer_states=100_000,
    max_grammar_size=200_000,
)


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


def check_constraint(c: Constraint) -> None:
    """Raises ValueError with the grammar engine's message when `c` cannot compile (checked
    without a tokenizer: what fails here fails on every model)."""
    grammar = c.grammar()
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise ValueError(f"the {c.kind} does not compile: {error.strip()}")
