"""Compiled structured-output grammars for one model, shared by a worker's requests.

A constraint (request/constraint.py) is compiled against the model's tokenizer once: the
cache keeps the pristine matcher per grammar text (least recently used out beyond `capacity`)
and every request gets its own copy (`deep_copy`, microseconds). Compiling runs in a thread,
never on the event loop or the engine thread, within `compile_timeout_s`; what the grammar
engine refuses, or what takes longer, is INVALID_ARGUMENT before anything is allocated.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import llguidance

from splitserve.request.constraint import Constraint, parser_limits
from splitserve.request.errors import RequestError
from splitserve.request.tokenizer import TOKENIZER_FILE


class GrammarCache:
    def __init__(
        self,
        model_path: str | Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        capacity: int = 64,
        compile_timeout_s: float = 10.0,
    ) -> None:
        self.tokenizer_file = Path(model_path) / TOKENIZER_FILE
        self.vocab_size, self.eos = vocab_size, list(eos_token_ids)
        self.capacity, self.compile_timeout_s = capacity, compile_timeout_s
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # compiles run in threads; the dict is shared
        self.compiles = 0  # grammars compiled (cache misses), for tests and the benchmark
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
                )
            return self._tokenizer

    def compile_now(self, c: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for `c` (blocking: call it from a thread). RequestError when the
        grammar engine refuses the constraint."""
        key = c.key
        with self._lock:
            pristine = self._compiled.get(key)
            if pristine is not None:
                self._compiled.move_to_end(key)
                return pristine.deep_copy()
        try:
            grammar = c.grammar()
        except ValueError as exc:
            raise RequestError.invalid(f"sampling.{c.kind}: {exc}") from None
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, limits=parser_limits())
        if self.on_compile is not None:
            self.on_compile(time.perf_counter() - t0)
        if matcher.is_error():
            raise RequestError.invalid(
                f"sampling.{c.kind}: the {c.kind} does not compile: {matcher.get_error().strip()}"
            )
        with self._lock:
            self.compiles += 1
            self._compiled[key] = matcher
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return matcher.deep_copy()

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
