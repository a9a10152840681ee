"""Compiled structured-output grammars for one model, shared by a worker's requests.

A constraint (request/constraint.py) is compiled against the model's tokenizer once: the
cache keeps the pristine matcher per grammar text (least recently used out beyond `capacity`)
and every request gets its own copy (`deep_copy`, microseconds).

Copies of one compiled matcher share its lexer behind one lock, so their masks are computed one
at a time however many threads fill them (measured: 8 copies in a bounded-string state took
22 ms with 1, 2 or 4 threads; 8 separate compiles 25 ms with one thread, 13 ms with two). So
the cache keeps up to `lineages` independent compiles of a grammar (the engine passes its mask
threads): the first requests of a grammar each compile one more, later ones get copies of
them in turn, and a batch's rows of one schema spread over that many locks.

Compiling runs in a thread, never on the event loop or the engine thread, within
`compile_timeout_s`; what the grammar engine refuses, or what takes longer, is INVALID_ARGUMENT
before anything is allocated. Each compile is probed there too (constraint.py `probe`: its first
mask and a few tokens), which refuses a grammar that blows the engine's limits at its start and
spends the compile's lexer fuel off the engine thread.

A lexer that hits a limit later stays broken for every copy that shares it: the engine
`discard`s the grammar's compiles, so the next request of it compiles afresh.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import llguidance

from splitserve.request.constraint import Constraint, engine_message, parser_limits, probe
from splitserve.request.errors import RequestError
from splitserve.request.tokenizer import TOKENIZER_FILE

# llguidance's slicer: a mask whose lexer allows every token of a slice takes the slice whole
# instead of walking its part of the token trie. Its default JSON slices bound string content
# at 10, 30 and any length, so a string with `maxLength` under 10 (or a longer one near its
# end) walks the whole 128k-token trie on every step (~1.5 ms a row). One slice per short
# length takes those whole too: on Llama 3's vocabulary a row's p99 fill went 1.43-1.52 ->
# 0.98-1.01 ms with decode.py's schema, unchanged with a mid-size schema (stop 58's note).
_JSON_CHAR = r'[^"\\\x00-\x1F\x7F]'
MASK_SLICES = (
    [r"[\x20\x0A\x0D\x09]+"]
    + [f"{_JSON_CHAR}{{1,{n}}}" for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20, 30)]
    + [f"{_JSON_CHAR}+"]
)


class GrammarCache:
    def __init__(
        self,
        model_path: str | Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        capacity: int = 64,
        compile_timeout_s: float = 10.0,
        lineages: int = 1,
    ) -> None:
        self.tokenizer_file = Path(model_path) / TOKENIZER_FILE
        self.vocab_size, self.eos = vocab_size, list(eos_token_ids)
        self.capacity, self.compile_timeout_s = capacity, compile_timeout_s
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.lineages = max(1, lineages)
        # grammar text -> its independent compiles, and how many copies each has handed out
        self._compiled: OrderedDict[str, list[llguidance.LLMatcher]] = OrderedDict()
        self._handed: dict[str, int] = {}
        self._lock = threading.Lock()  # compiles run in threads; the dict is shared
        self.compiles = 0  # grammars compiled (cache misses), for tests and the benchmark
        self.lineage_compiles = 0  # further independent compiles of a cached grammar
        self.on_compile: Callable[[float], None] | None = None  # seconds per miss (metrics)

    def tokenizer(self) -> llguidance.LLTokenizer:
        """The model's tokenizer for the grammar engine, built on first use (~1 s at 128k)."""
        with self._lock:
            if self._tokenizer is None:
                if not self.tokenizer_file.is_file():
                    raise RequestError.invalid(
                        f"structured output needs the model's {TOKENIZER_FILE}, and this worker "
                        "has none; start it on a checkpoint with one"
                    )
                self._tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_file.read_text(),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos or None,
                    slices=MASK_SLICES,
                )
            return self._tokenizer

    def compile_now(self, c: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for `c` (blocking: call it from a thread). RequestError when the
        grammar engine refuses the constraint."""
        key = c.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                if len(compiled) >= self.lineages:  # all compiled: copies in turn
                    turn = self._handed[key] = self._handed[key] + 1
                    return compiled[turn % len(compiled)].deep_copy()
        try:
            grammar = c.grammar()
        except ValueError as exc:
            raise RequestError.invalid(f"sampling.{c.kind}: {exc}") from None
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, limits=parser_limits())
        bad = engine_message(matcher.get_error()) if matcher.is_error() else ""
        over = "" if bad else probe(matcher, self.tokenizer().eos_tokens)
        if self.on_compile is not None:  # (the probe's masks included: the lexer's build)
            self.on_compile(time.perf_counter() - t0)
        if bad:
            raise RequestError.invalid(f"sampling.{c.kind}: the {c.kind} does not compile: {bad}")
        if over:
            raise RequestError.invalid(
                f"sampling.{c.kind}: the {c.kind} exceeds the grammar engine's limits: {over}"
            )
        with self._lock:
            compiled = self._compiled.setdefault(key, [])
            self._compiled.move_to_end(key)
            if compiled:
                self.lineage_compiles += 1
            else:
                self.compiles += 1
                self._handed[key] = 0
            if len(compiled) < self.lineages:
                compiled.append(matcher)
            while len(self._compiled) > self.capacity:
                old, _ = self._compiled.popitem(last=False)
                self._handed.pop(old, None)
        return matcher.deep_copy()

    def discard(self, c: Constraint) -> None:
        """Forgets `c`'s compiles (one of their lexers hit a limit: broken for every copy)."""
        with self._lock:
            self._compiled.pop(c.key, None)
            self._handed.pop(c.key, None)

    def compiled_count(self, c: Constraint) -> int:
        """How many independent compiles of `c` the cache holds (0: not cached)."""
        with self._lock:
            return len(self._compiled.get(c.key, ()))

    async def matcher(self, c: Constraint | None) -> llguidance.LLMatcher | None:
        """The request's own matcher (None without a constraint), compiled off the loop."""
        if c is None:
            return None
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(self.compile_now, c), self.compile_timeout_s
            )
        except TimeoutError:
            raise RequestError.invalid(
                f"sampling.{c.kind}: compiling it took over {self.compile_timeout_s:g} s; "
                "send a simpler constraint"
            ) from None
