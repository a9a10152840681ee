"""Streams the text of generated tokens, one token at a time, as valid UTF-8.

Byte-level tokenizers split one character over several tokens (an emoji is often four),
and decoding such a token alone gives U+FFFD. We use the prefix/read-offset technique of
vLLM and TGI. The detokenizer keeps a small window of token ids,

    window:  [ prefix (already emitted, context) | pending (not emitted yet) ]
              0 ....................... read_offset ................... end

and for each new token decodes the whole window; when that text is longer than the
prefix's text and does not end in U+FFFD, the difference is emitted and the pending
tokens become the next prefix (older ones are dropped). Decoding some context, and not
the new tokens alone, keeps the decoder's joins right (e.g. the leading space that a
SentencePiece decoder strips from the first token of a string). The window starts with
the prompt's last tokens, so a token costs O(window), not O(sequence).

The window only grows while tokens keep ending in an incomplete (or invalid) character.
`flush()` returns what is still held back when the sequence ends; for a byte-level
tokenizer, `"".join(add(t) for t in out) + flush() == tokenizer.decode(out)` (when the
prompt does not itself end inside a character).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first output token (vLLM uses 5 as well).
PROMPT_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas that never split a character."""

    def __init__(
        self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._tokens: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._tokens)  # decode(tokens[:read_offset])
        self._num_output = 0

    @property
    def num_output_tokens(self) -> int:
        return self._num_output

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ('' while held back)."""
        self._num_output += 1
        self._tokens.append(token_id)
        new_text = self._decode(self._tokens)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(new_text)

    def flush(self) -> str:
        """Text still held back at the end of the sequence (an unfinished character shows
        as U+FFFD, exactly as in a full decode); '' when nothing is pending."""
        if self._read_offset == len(self._tokens):
            return ""
        return self._advance(self._decode(self._tokens))

    def _advance(self, new_text: str) -> str:
        """Emit new_text past the prefix; the unread tokens become the next prefix."""
        delta = new_text[len(self._prefix_text) :]
        self._tokens = self._tokens[self._read_offset :]
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._tokens)
        return delta
