"""In-process generation: prefill then decode in one process, one batch.

This is the single-process oracle the disaggregated path is compared against ("isolated
greedy generation"), and what `splitserve complete` runs. It allocates blocks as sequences
grow and frees them as they finish; it does not preempt (the caller sizes the pool).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.engine.grammar_masks import grammar_lineages
from splitserve.engine.model_runner import DecodeLane, ModelRunner, PrefillChunk
from splitserve.engine.sampler import Sampler, SeqSamplingInfo
from splitserve.request.block_allocator import BlockAllocator
from splitserve.request.grammar_cache import GrammarCache
from splitserve.request.sampling_params import SamplingParams
from splitserve.request.stop_checker import StopChecker


@dataclass
class Completion:
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    matcher: object | None = None  # structured output: advanced with every token


class OfflineEngine:
    def __init__(self, runner: ModelRunner, tokenizer=None, seed: int = 0) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.allocator = BlockAllocator(runner.num_blocks)
        self.eos = tuple(runner.model_config.eos_token_ids)
        self.sampler = Sampler(seed, self.eos)
        mc = runner.model_config
        self.grammars = GrammarCache(
            runner.engine_config.model_path, mc.vocab_size, self.eos, lineages=grammar_lineages()
        )

    def _blocks_for(self, seq: Completion, length: int) -> None:
        need = -(-length // self.runner.block_size) - len(seq.block_table)
        if need > 0:
            got = self.allocator.allocate(need)
            if got is None:
                raise MemoryError(
                    "KV pool exhausted; raise cache.num_blocks or send fewer requests"
                )
            seq.block_table.extend(got.block_ids)

    def _accept(self, seqs: list[Completion], logits, checkers, detoks) -> None:
        infos = [
            SeqSamplingInfo(s.params, s.prompt_token_ids, s.token_ids, s.matcher) for s in seqs
        ]
        out = self.sampler.sample(logits, infos)
        for s, tok, lp in zip(seqs, out.token_ids, out.logprobs):
            if s.matcher is not None and not s.matcher.consume_token(tok):
                raise RuntimeError(f"token {tok} broke the constraint: {s.matcher.get_error()}")
            s.token_ids.append(tok)
            s.logprobs.append(lp)
            delta = detoks[id(s)].add(tok) if detoks else ""
            result = checkers[id(s)].update(tok, delta)
            s.text += result.text
            if result.finish_reason == "length" and detoks:
                s.text += detoks[
                    id(s)
                ].flush()  # an unfinished multi-byte char, as a full decode shows it
            if result.finish_reason is not None:
                s.finish_reason = result.finish_reason
                self.allocator.free(s.block_table)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[Completion]:
        from splitserve.request.detokenizer import IncrementalDetokenizer

        seqs = [Completion(list(p), sp) for p, sp in zip(prompts, params)]
        for s in seqs:  # (RequestError, INVALID_ARGUMENT, for a constraint that cannot compile)
            if s.params.constraint is not None:
                s.matcher = self.grammars.compile_now(s.params.constraint)
        max_len = self.runner.max_model_len
        checkers = {
            id(s): StopChecker(s.params, self.eos, max_len, len(s.prompt_token_ids)) for s in seqs
        }
        detoks = (
            {id(s): IncrementalDetokenizer(self.tokenizer, s.prompt_token_ids) for s in seqs}
            if self.tokenizer
            else {}
        )
        for s in seqs:
            if not s.prompt_token_ids or len(s.prompt_token_ids) >= max_len:
                raise ValueError(
                    f"prompt length {len(s.prompt_token_ids)} must be in [1, {max_len})"
                )
            self._blocks_for(s, len(s.prompt_token_ids))
        logits = self.runner.prefill(
            [PrefillChunk(s.prompt_token_ids, 0, s.block_table) for s in seqs]
        )
        self._accept(seqs, logits, checkers, detoks)
        while running := [s for s in seqs if s.finish_reason is None]:
            for s in running:
                self._blocks_for(s, len(s.prompt_token_ids) + len(s.token_ids))
            lanes = [
                DecodeLane(
                    s.token_ids[-1], len(s.prompt_token_ids) + len(s.token_ids) - 1, s.block_table
                )
                for s in running
            ]
            self._accept(running, self.runner.decode(lanes), checkers, detoks)
        return seqs
