"""Constraints past the grammar engine's limits end to end (the session's real router, prefill and
decode workers; tiny model). The attack audit's `(a{1000}){1000}` (as a regex, a JSON schema's
pattern, a Lark terminal) compiled and validated, then failed the decode worker's second mask:
UNAVAILABLE after one token ("send the request again"), the engine thread stalled for others.
Now: INVALID_ARGUMENT / HTTP 400 with the engine's message from the router, and from each
worker at its own boundary; a state that blows the limits only later (past the compile's probe)
ends its request with INVALID_ARGUMENT at the decode worker, naming the output token; another
caller's greedy stream keeps its tokens; every KV block is free after."""

from __future__ import annotations

import json
import threading

import grpc
import openai
import pytest
from openai_helpers import MODEL

from splitserve.protos import generate_pb2, worker_pb2, worker_pb2_grpc

BLOWN = "(a{1000}){1000}"
LATE = "x+|y(a{1000}){1000}"  # healthy at token 0 (the probe follows "x"), blown after "y"
FORMS = {
    "regex": BLOWN,
    "json_schema": json.dumps({"type": "string", "pattern": f"^{BLOWN}$"}),
    "grammar": f"start: /{BLOWN}/",
}
SAYS = ("exceeds the grammar engine's limits", "too many expressions constructed")


def _token(stack, text: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(stack.model / "tokenizer.json")).token_to_id(text)


def test_the_audits_constraints_are_refused_up_front_everywhere(stack, client):
    for kind, text in FORMS.items():
        with pytest.raises(grpc.RpcError) as info:
            stack.grpc_generate("hello", generate_pb2.SamplingParams(max_tokens=3, **{kind: text}))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert f"sampling.{kind}" in info.value.details(), info.value.details()
        assert all(s in info.value.details() for s in SAYS), info.value.details()
    schema = json.loads(FORMS["json_schema"])
    with pytest.raises(openai.BadRequestError) as http_info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=3,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
        )
    assert http_info.value.status_code == 400
    assert all(s in http_info.value.body["message"] for s in SAYS), http_info.value.body
    with pytest.raises(openai.BadRequestError) as http_info:
        client.completions.create(
            model=MODEL,
            prompt="hi",
            max_tokens=3,
            extra_body={"structured_outputs": {"regex": BLOWN}},
        )
    assert all(s in http_info.value.body["message"] for s in SAYS), http_info.value.body
    # each worker at its own trust boundary, before anything is allocated
    sp = generate_pb2.SamplingParams(max_tokens=3, regex=BLOWN)
    with grpc.insecure_channel(stack.prefill) as ch, pytest.raises(grpc.RpcError) as info:
        worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(
            worker_pb2.PrefillRequest(request_id="blown", prompt_token_ids=[1, 2], sampling=sp),
            timeout=60,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(s in info.value.details() for s in SAYS), info.value.details()
    with grpc.insecure_channel(stack.decode) as ch, pytest.raises(grpc.RpcError) as info:
        req = worker_pb2.DecodeRequest(
            request_id="blown",
            prompt_token_ids=[1, 2],
            first_token_id=_token(stack, "a"),
            sampling=sp,
        )
        list(worker_pb2_grpc.DecodeWorkerStub(ch).Decode(req, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(s in info.value.details() for s in SAYS), info.value.details()
    stack.assert_free()


def test_a_later_state_past_the_limits_ends_with_invalid_argument_at_the_decode_worker(stack):
    """Past the probe: the decode worker's mask after "y" runs out of lexer fuel. Handed the
    first token ("y"), or sampling it itself (colocated, "y" forced by logit_bias): the stream
    ends INVALID_ARGUMENT naming output token 2, and the worker serves on."""
    y = _token(stack, "y")
    sp = generate_pb2.SamplingParams(max_tokens=8, temperature=1.0, seed=1, regex=LATE)
    forced = generate_pb2.SamplingParams()
    forced.CopyFrom(sp)
    forced.logit_bias[y] = 100.0
    errors = stack.decode_finished("error")
    with grpc.insecure_channel(stack.decode) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        for rid, first, params in (("handed", y, sp), ("colocated", None, forced)):
            req = worker_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=[1, 2, 3], sampling=params
            )
            if first is not None:
                req.first_token_id = first
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Decode(req, timeout=60))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (rid, info.value)
            details = info.value.details()
            assert "exceeded the grammar engine's limits at output token 2" in details, details
            assert "too many expressions constructed" in details, details
    assert stack.decode_finished("error") == errors + 2
    # The same constraint on its healthy branch: served. Forced onto "x" the way the failing
    # requests are forced onto "y", and seeded: unseeded, the prefill worker samples token 0
    # with a seed drawn from its own generator (engine seed 0), so the branch taken depended on
    # how many unseeded requests the session's workers had served before (one more, after
    # test_openai_errors.py, and token 0 was "y": the late failure, not the healthy branch).
    x = _token(stack, "x")
    healthy = generate_pb2.SamplingParams(max_tokens=4, seed=1, regex=LATE, logit_bias={x: 100.0})
    chunks = stack.grpc_generate("hello", healthy)
    assert [t for c in chunks for t in c.token_ids] == [x] * 4, chunks
    assert "".join(c.text for c in chunks) == "xxxx"
    stack.assert_free()


def test_through_the_router_the_late_failure_stays_invalid_argument(stack):
    y = _token(stack, "y")
    sp = generate_pb2.SamplingParams(max_tokens=8, regex=LATE, logit_bias={y: 100.0})
    try:
        with pytest.raises(grpc.RpcError) as info:
            stack.grpc_generate("hello", sp)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert "at output token 2" in info.value.details()
    finally:
        stack.assert_free()


def test_refused_constraints_leave_another_callers_stream_alone(stack):
    """t24 of the audit: a greedy stream, alone and while five of the audit's requests arrive
    (each refused at the router: no worker compiles or masks it); the same tokens."""
    sp = generate_pb2.SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)
    alone = [t for c in stack.grpc_generate("hello", sp) for t in c.token_ids]
    errors, codes = stack.decode_finished("error"), []

    def attack():
        for _ in range(5):
            try:
                stack.grpc_generate("hello", generate_pb2.SamplingParams(regex=BLOWN, max_tokens=5))
            except grpc.RpcError as e:
                codes.append(e.code())

    t = threading.Thread(target=attack)
    t.start()
    beside = [t for c in stack.grpc_generate("hello", sp) for t in c.token_ids]
    t.join()
    assert beside == alone and len(alone) == 60
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 5
    assert stack.decode_finished("error") == errors  # none reached the decode worker's engine
    stack.assert_free()
