"""Fuzzing Generate with mutated-valid requests: a valid request with one to three fields at an edge
(stop strings, request ids, vocabulary edges, the room left by the prompt, logit_bias, ...), each
with its expected outcome (fuzz_support.py for the shared checks)."""

from __future__ import annotations

import secrets

import grpc
from fault_helpers import (
    SLOW_PREFILL,
    SLOW_PULL,
    Ledger,
    router_outcomes,
)
from fuzz_messages import ODD_CHARS
from fuzz_support import (
    C,
    Front,
    _end,
    fresh_id,
    fuzz_settings,
)
from hypothesis import assume, given
from hypothesis import strategies as st
from router_helpers import MAX_MODEL_LEN, greedy, ids_request
from test_bad_input import VOCAB, _send

from splitserve.protos import generate_pb2

# ---- 2. Generate with mutated-valid requests -----------------------------------------------------
LONG_PROMPT = [(7 * i) % (VOCAB - 1) + 1 for i in range(MAX_MODEL_LEN - 6)]  # room for 6 tokens
PRINTABLE_ODD = st.text(
    st.characters(codec="utf-8", categories=["L", "M", "N", "P", "S"]) | st.sampled_from(" #:/é😀"),
    min_size=1,
    max_size=40,
).filter(str.isprintable)
NON_PRINTABLE = st.builds(
    lambda a, c, b: a + c + b,
    st.text(st.characters(codec="ascii", min_codepoint=0x21), max_size=5),
    st.sampled_from(["\x00", "\n", "\x7f", "\x85", "\u200b", "\u2028", "\ufeff", "\u202e"]),
    st.text(st.characters(codec="ascii", min_codepoint=0x21), max_size=5),
)
ODD_TEXT = st.text(
    st.sampled_from(ODD_CHARS) | st.characters(codec="utf-8"), min_size=1, max_size=40
)


@st.composite
def mutated_generate(draw) -> tuple[generate_pb2.GenerateRequest, str | None, list[str]]:
    """A valid greedy request (a short prompt, max_tokens 4) with one to three of the mutations
    below; (request, "ok" | "invalid" | None (either), the mutations). A mutation is valid,
    invalid, or (between the router's configurable limits and the workers' hard ones) either."""
    req = ids_request([1, 44, 45, 46, 200, 201, 202], greedy(4), request_id=fresh_id("fzg"))
    sp = req.sampling
    verdicts: list[str | None] = []
    names = draw(
        st.lists(
            st.sampled_from(
                [  # applied in this order: the prompt's text, then its ids
                    "odd_text",
                    "vocab_edges",
                    "past_vocab",
                    "odd_request_id",
                    "request_id_len",
                    "non_printable_id",
                    "room",
                    "min_tokens",
                    "stop",
                    "stop_count",
                    "stop_len",
                    "stop_token_ids",
                    "logit_bias",
                    "top_k",
                    "seed",
                    "logprobs",
                    "penalties",
                    "flags",
                    "no_sampling_fields",
                ]
            ),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    if "room" in names:  # it sets the prompt itself
        names = [n for n in names if n not in ("odd_text", "vocab_edges", "past_vocab")]
    ids = [n for n in names if n.endswith(("request_id", "request_id_len", "_id"))]
    names = [n for n in names if n not in ids[1:]]  # one request id
    stops = [n for n in names if n in ("stop", "stop_count", "stop_len")]
    names = [n for n in names if n not in stops[1:]]  # one stop list: a later one overwrites it
    order = ["odd_text", "vocab_edges", "past_vocab"]
    names.sort(key=lambda n: order.index(n) if n in order else len(order))
    for name in names:  # "room" and "min_tokens" last: they depend on the prompt and max_tokens
        if name == "vocab_edges":
            req.token_ids.ids[:] = draw(
                st.lists(st.sampled_from([0, 1, VOCAB - 2, VOCAB - 1]), min_size=1, max_size=8)
            )
            verdicts.append("ok")
        elif name == "past_vocab":
            req.token_ids.ids.append(draw(st.sampled_from([VOCAB, VOCAB + 1, 2**31, 2**32 - 1])))
            verdicts.append("invalid")
        elif name == "odd_text":
            req.text = draw(ODD_TEXT)  # at most 40 characters: well under max_model_len tokens
            verdicts.append("ok")
        elif name == "odd_request_id":
            rid = draw(PRINTABLE_ODD)
            assume(not rid.startswith((SLOW_PREFILL, SLOW_PULL)))
            req.request_id = rid + "-" + fresh_id("")  # unique, printable, short
            verdicts.append("ok")
        elif name == "request_id_len":
            n = draw(st.sampled_from([255, 256, 257, 1025]))
            req.request_id = "r" * (n - 8) + secrets.token_hex(4)
            verdicts.append("ok" if n <= 256 else "invalid")
        elif name == "non_printable_id":
            req.request_id = draw(NON_PRINTABLE)
            verdicts.append("invalid")
        elif name == "stop":
            sp.stop[:] = draw(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=4))
            verdicts.append("ok")
        elif name == "stop_count":
            n = draw(st.sampled_from([16, 17, 64, 65]))
            sp.stop[:] = [f"zz{i}" for i in range(n)]
            verdicts.append({16: "ok", 65: "invalid"}.get(n))
        elif name == "stop_len":
            n = draw(st.sampled_from([256, 257, 1024, 1025]))
            sp.stop[:] = [draw(st.sampled_from(["z", "é", "😀"])) * n]
            verdicts.append({256: "ok", 1025: "invalid"}.get(n))
        elif name == "stop_token_ids":
            n = draw(st.sampled_from([1, 64, 65]))
            sp.stop_token_ids[:] = [(VOCAB - 1 - i) for i in range(n)]
            verdicts.append("ok" if n <= 64 else "invalid")
        elif name == "logit_bias":
            kind = draw(st.sampled_from(["edges", "300", "301", "nan"]))
            sp.logit_bias.clear()
            sp.logit_bias.update(
                {
                    "edges": {0: -100.0, VOCAB - 1: 100.0, 5: -0.0},
                    "300": {t: 0.5 for t in range(300)},
                    "301": {t: 0.5 for t in range(301)},
                    "nan": {3: float("nan")},
                }[kind]
            )
            verdicts.append("ok" if kind in ("edges", "300") else "invalid")
        elif name == "top_k":
            sp.top_k = draw(st.sampled_from([1, VOCAB - 1, VOCAB, 2**32 - 1]))
            sp.temperature = draw(st.sampled_from([0.0, 1.0]))
            verdicts.append("ok")
        elif name == "seed":
            sp.seed = draw(st.sampled_from([0, 2**63, 2**64 - 1]))
            sp.temperature = 1.0
            verdicts.append("ok")
        elif name == "logprobs":
            sp.logprobs = draw(st.sampled_from([0, 20, 21]))
            verdicts.append("ok" if sp.logprobs <= 20 else "invalid")
        elif name == "penalties":
            sp.presence_penalty = draw(st.sampled_from([-2.0, 2.0, 2.0000002]))
            sp.frequency_penalty = draw(st.sampled_from([-2.0, 2.0]))
            sp.repetition_penalty = draw(st.sampled_from([1e-45, 1.0, 3.4028234e38]))
            verdicts.append("ok" if abs(sp.presence_penalty) <= 2 else "invalid")
        elif name == "flags":
            sp.ignore_eos = draw(st.booleans())
            sp.include_stop_str_in_output = draw(st.booleans())
            req.skip_special_tokens = draw(st.booleans())
            verdicts.append("ok")
        elif name == "no_sampling_fields":
            sp.ClearField("temperature")
            sp.min_p = draw(st.sampled_from([0.0, 1.0]))
            sp.top_p = draw(st.sampled_from([1.4e-45, 1.0]))
            verdicts.append("ok")
    if "room" in names:  # a prompt that leaves 6 tokens: max_tokens exactly that, or one more
        req.token_ids.ids[:] = LONG_PROMPT
        over = draw(st.booleans())
        sp.max_tokens = MAX_MODEL_LEN - len(LONG_PROMPT) + over
        verdicts.append("invalid" if over else "ok")
    if "min_tokens" in names:
        over = draw(st.booleans())
        sp.min_tokens = sp.max_tokens + over
        verdicts.append("invalid" if over else "ok")
    verdict = (
        "invalid" if "invalid" in verdicts else ("ok" if all(v == "ok" for v in verdicts) else None)
    )
    return req, verdict, names


def test_generate_mutated_valid_requests(front, cluster, oracle, logs):
    ledger = Ledger("fzgen", _outcomes(front))
    with grpc.insecure_channel(
        front.address, options=[("grpc.max_send_message_length", 64 * 2**20)]
    ) as channel:

        @fuzz_settings(150)
        @given(mutated_generate())
        def check(case) -> None:
            req, verdict, names = case
            code, chunks, details = _send(channel, ledger, req.SerializeToString())
            if verdict == "invalid" or (verdict is None and code != C.OK):
                assert code == C.INVALID_ARGUMENT, (names, code, details)
                return
            assert code == C.OK, (names, details)
            _served(req, chunks)

        check()
    _end(front, cluster, oracle, ledger)


def _served(req: generate_pb2.GenerateRequest, chunks: list[generate_pb2.GenerateResponse]) -> None:
    """A served stream keeps its promises: the caller's id on every chunk, at most max_tokens
    tokens, no stop before min_tokens, one logprob per token, a finish reason and usage last."""
    sp = req.sampling
    assert chunks, "a served request sends at least one chunk"
    assert all(c.request_id == req.request_id for c in chunks), (
        req.request_id,
        chunks[0].request_id,
    )
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) <= sp.max_tokens
    last = chunks[-1]
    assert last.finish_reason in (
        generate_pb2.FINISH_REASON_STOP,
        generate_pb2.FINISH_REASON_LENGTH,
    )
    assert all(c.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    if not sp.stop:  # (a stop string may drop the tokens after its match)
        assert tokens and last.usage.completion_tokens == len(tokens)
    if req.WhichOneof("prompt") == "token_ids":
        assert last.usage.prompt_tokens == len(req.token_ids.ids)
    if last.finish_reason == generate_pb2.FINISH_REASON_LENGTH:
        assert len(tokens) == sp.max_tokens
    if sp.min_tokens and not sp.stop:
        assert len(tokens) >= sp.min_tokens
    if sp.HasField("logprobs"):
        assert sum(len(c.logprobs) for c in chunks) == len(tokens)
        assert all(len(lp.top_logprobs) == sp.logprobs for c in chunks for lp in c.logprobs)
    text = "".join(c.text for c in chunks)
    if sp.stop and not sp.include_stop_str_in_output:
        assert not any(s in text for s in sp.stop), (list(sp.stop), text)
    assert all(t not in sp.stop_token_ids for t in tokens[:-1])  # a stop token ends the stream


def _outcomes(front: Front) -> float:
    return router_outcomes(front.metrics)
