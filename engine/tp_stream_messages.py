"""The streamed hand-over's tensor-parallel commands (prefill_worker/kv_stream_tp.py): rank 0's
stream hub tells each follower's hub what its engine does, so that every rank streams its own
KV heads of the same pieces. Same encoding as tp_messages.py (which registers them):

    kind  name         fields
    11    stream_add   request_id: text, stream_token: text, prompt_len: int
    12    stream_step  chunks: list of (request_id: text, start: int, end: int, block_table: ints)
    13    stream_end   request_id: text, kind: int (0 finished, 1 aborted or lease dropped),
                       lease_id: text, num_tokens: int, finished: int, message: text
"""

from __future__ import annotations

from collections.abc import Sequence


def _enc_stream_add(w, request_id: str, token: str, prompt_len: int) -> None:
    w.text(request_id)
    w.text(token)
    w.i64(prompt_len)


def _dec_stream_add(r) -> tuple:
    return r.text(), r.text(), r.i64()


def _enc_stream_step(w, chunks: Sequence[tuple]) -> None:
    w.count(len(chunks))
    for request_id, start, end, table in chunks:
        w.text(request_id)
        w.i64(start)
        w.i64(end)
        w.ints(table)


def _dec_stream_step(r) -> tuple:
    return (r.items(lambda: (r.text(), r.i64(), r.i64(), tuple(r.ints()))),)


def _enc_stream_end(
    w, request_id: str, kind: int, lease_id: str, num_tokens: int, finished: int, message: str
) -> None:
    w.text(request_id)
    w.i64(kind)
    w.text(lease_id)
    w.i64(num_tokens)
    w.i64(finished)
    w.text(message)


def _dec_stream_end(r) -> tuple:
    return r.text(), r.i64(), r.text(), r.i64(), r.i64(), r.text()


STREAM_CODECS = {
    "stream_add": (11, _enc_stream_add, _dec_stream_add),
    "stream_step": (12, _enc_stream_step, _dec_stream_step),
    "stream_end": (13, _enc_stream_end, _dec_stream_end),
}
