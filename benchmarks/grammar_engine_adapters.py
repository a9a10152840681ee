"""The grammar engines behind one interface (grammar_engines.py runs one per child process):
compile, matchers, batch advance + fill, reset; each imports its engine lazily."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_vocab, also when imported
from bench_vocab import token_bytes  # noqa: E402


class Llguidance:
    """Compact JSON as splitserve compiles it (request/constraint.py)."""

    def __init__(self, tokenizer_json: Path, vocab: int, eos: int) -> None:
        import llguidance

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab, eos_token=eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False}
        )
        m = self.ll.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers, out) -> None:
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], out)

    def advance(self, pairs) -> None:
        ok = self.executor.consume_token_par(pairs)
        assert all(ok), [m.get_error() for m, _ in pairs if m.is_error()]

    def reset(self, m) -> None:
        m.reset()


class Xgrammar:
    def __init__(self, tokenizer_json: Path, vocab: int, eos: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, out) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, out)

    def advance(self, pairs) -> None:
        ok = self.xgr.BatchGrammarMatcher.batch_accept_token(
            [m for m, _ in pairs], [t for _, t in pairs]
        )
        assert all(ok)

    def reset(self, m) -> None:
        m.reset()


class OutlinesCore:
    """JSON Schema -> regex -> token index over the whole vocabulary (built at compile)."""

    def __init__(self, tokenizer_json: Path, vocab: int, eos: int) -> None:
        import outlines_core

        self.oc = outlines_core
        pieces, special = token_bytes(tokenizer_json)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(pieces[:vocab]):
            if i not in special:  # special tokens are never text
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, by_bytes)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), "")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matchers, out) -> None:
        words = out.shape[1]
        for i, g in enumerate(matchers):
            g.write_mask_into(out[i].ctypes.data, words, 4)

    def advance(self, pairs) -> None:
        for g, t in pairs:
            g.advance(t, return_tokens=False)

    def reset(self, m) -> None:
        m.reset()


ADAPTERS = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines_core": OutlinesCore}
