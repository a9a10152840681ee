"""Bad input against a real router process: bytes that are no GenerateRequest at all (sent through
a generic channel with identity serializers), random field values (hypothesis), and a table of
stated refusals. Undecodable bytes are INVALID_ARGUMENT naming the message type (service/grpc_guard.py;
the servicer never runs), a decodable but invalid request is INVALID_ARGUMENT before any worker
is touched; nothing else ever comes back, no traceback is logged, and the services keep serving."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest
from fault_helpers import Ledger, finish_case, router_outcomes
from google.protobuf.message import DecodeError
from helpers_procs import free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_helpers import MAX_MODEL_LEN

from splitserve.protos import generate_pb2, generate_pb2_grpc

GENERATE = "/splitserve.v1.GenerateService/Generate"
VOCAB = 512  # the tiny model's
SETTINGS = settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_ids = itertools.count()


@pytest.fixture(scope="module")
def router(cluster, tmp_path_factory):
    """(address, metrics port) of a router process in front of the shared workers."""
    from helpers_procs import ProcessGroup

    metrics = free_port()
    with ProcessGroup(tmp_path_factory.mktemp("fuzz_router")) as procs:
        proc = procs.router(
            cluster.model,
            "--prefill",
            cluster.prefill,
            "--decode",
            cluster.decode,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--metrics-port",
            str(metrics),
        )
        yield proc.address, metrics
        assert proc.stop() == 0 and "Traceback" not in proc.log(), proc.log()


def _send(channel: grpc.Channel, ledger: Ledger, raw: bytes) -> tuple[grpc.StatusCode, list, str]:
    """Sends raw bytes as a Generate request; (status, response chunks, details), in the ledger."""
    try:
        generate_pb2.GenerateRequest.FromString(raw)
        decodable = True
    except DecodeError:
        decodable = False
    rid = f"{ledger.name}-{next(_ids)}"
    ledger.sent.append(rid)
    try:
        chunks = [
            generate_pb2.GenerateResponse.FromString(c)
            for c in channel.unary_stream(GENERATE)(raw, timeout=60)
        ]
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        chunks, code, details = [], err.code(), err.details() or ""
    ledger.record(rid, code.name, counted=decodable)
    assert code in (
        {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
        if decodable
        else {grpc.StatusCode.INVALID_ARGUMENT}
    ), (raw[:80], code, details)
    assert decodable or "not a valid splitserve.v1.GenerateRequest" in details, details
    assert code != grpc.StatusCode.INVALID_ARGUMENT or details, "a refusal says what to fix"
    return code, chunks, details


def _finish(router, ledger: Ledger, oracle, cluster) -> None:
    address, metrics = router

    async def end():
        async with grpc.aio.insecure_channel(address) as ch:
            await finish_case(
                ledger,
                generate_pb2_grpc.GenerateServiceStub(ch),
                oracle,
                [cluster.prefill],
                [cluster.decode],
                router=metrics,
            )

    asyncio.run(end())


def test_random_bytes_are_refused_and_the_router_keeps_serving(router, cluster, oracle):
    ledger = Ledger("raw", router_outcomes(router[1]))
    valid = generate_pb2.GenerateRequest(
        text="Hello", sampling=generate_pb2.SamplingParams(max_tokens=2)
    )
    with grpc.insecure_channel(router[0]) as channel:

        @SETTINGS
        @given(
            st.binary(max_size=96)
            | st.builds(lambda cut: valid.SerializeToString()[:cut], st.integers(1, 12))
        )
        def check(raw: bytes) -> None:
            _send(channel, ledger, raw)

        check()
        # hand-made wrecks: a string that is not UTF-8, a length past the end, wire type 7
        for raw in (b"\x12\x03\xff\xfe\xfd", b"\x12\x40abc", b"\x0f\x01", b"\x1a\x02\x0a\x05"):
            code, _, details = _send(channel, ledger, raw)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in details
    # the workers' own services, unary and streamed, refuse such bytes the same way
    for address, method, streamed in (
        (cluster.prefill, "/splitserve.v1.PrefillWorker/Prefill", False),
        (cluster.decode, "/splitserve.v1.DecodeWorker/Decode", True),
    ):
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
            if streamed:
                list(channel.unary_stream(method)(b"\x12\x40abc", timeout=10))
            else:
                channel.unary_unary(method)(b"\x12\x40abc", timeout=10)
        assert (
            err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "protobuf" in err.value.details()
        )
    _finish(router, ledger, oracle, cluster)


def f32(**kw):
    return st.floats(width=32, allow_nan=False, allow_infinity=False, **kw)


EPS = 2.0**-7  # bounds below are exact float32 values
NAN_INF = st.sampled_from([float("nan"), float("inf"), float("-inf")])
VALID = dict(  # sampling values the router accepts
    max_tokens=st.integers(1, 4),
    temperature=f32(min_value=0, max_value=2),
    top_p=f32(min_value=EPS, max_value=1),
    top_k=st.integers(0, 50),
    min_p=f32(min_value=0, max_value=1),
    seed=st.integers(0, 2**64 - 1),
    repetition_penalty=f32(min_value=EPS, max_value=3),
    presence_penalty=f32(min_value=-2, max_value=2),
    frequency_penalty=f32(min_value=-2, max_value=2),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2),
    logprobs=st.integers(0, 20),
    logit_bias=st.dictionaries(
        st.integers(0, VOCAB - 1), f32(min_value=-100, max_value=100), max_size=3
    ),
)
BAD = dict(  # one out-of-range value per field
    max_tokens=st.just(0),
    temperature=f32(max_value=-EPS) | NAN_INF,
    top_p=f32(max_value=0) | f32(min_value=1 + EPS) | NAN_INF,
    min_p=f32(max_value=-EPS) | f32(min_value=1 + EPS) | NAN_INF,
    repetition_penalty=f32(max_value=0) | NAN_INF,
    presence_penalty=f32(min_value=2 + EPS) | f32(max_value=-2 - EPS),
    frequency_penalty=f32(min_value=2 + EPS) | NAN_INF,
    stop_token_ids=st.lists(st.integers(VOCAB, 2**32 - 1), min_size=1, max_size=2),
    logprobs=st.integers(21, 2**32 - 1),
    stop=st.just([""]),
    min_tokens=st.integers(5, 2**32 - 1),  # above every max_tokens drawn here (at most 4)
    logit_bias=st.dictionaries(  # an id past the vocabulary, or a bias outside [-100, 100]
        st.integers(VOCAB, 2**32 - 1), f32(min_value=-100, max_value=100), min_size=1, max_size=2
    )
    | st.dictionaries(
        st.integers(0, VOCAB - 1),
        f32(min_value=100 + EPS) | f32(max_value=-100 - EPS) | NAN_INF,
        min_size=1,
        max_size=2,
    ),
)


@st.composite
def one_bad_field(draw) -> tuple[generate_pb2.GenerateRequest, str | None]:
    """A valid request with at most one field out of range; (request, that field or None)."""
    sampling = {k: draw(v) for k, v in VALID.items() if draw(st.booleans())}
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    bad = draw(st.none() | st.sampled_from([*BAD, "prompt", "length"]))
    if bad in BAD:
        sampling[bad] = draw(BAD[bad])
    elif bad == "prompt":  # a token id past the vocabulary
        prompt[draw(st.integers(0, len(prompt) - 1))] = draw(st.integers(VOCAB, 2**32 - 1))
    elif bad == "length":
        prompt = prompt * (MAX_MODEL_LEN // len(prompt) + 1)
    sampling.setdefault("max_tokens", 4)
    if bad != "min_tokens" and draw(st.booleans()):  # valid: at most max_tokens
        sampling["min_tokens"] = draw(st.integers(0, sampling["max_tokens"]))
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(**sampling),
    )
    return req, {"prompt": "vocab", "length": "max_model_len"}.get(bad, bad)


def test_one_out_of_range_field_is_invalid_argument_naming_it(router, cluster, oracle):
    ledger = Ledger("fields", router_outcomes(router[1]))
    with grpc.insecure_channel(router[0]) as channel:

        @SETTINGS
        @given(one_bad_field())
        def check(case) -> None:
            req, bad = case
            code, chunks, details = _send(channel, ledger, req.SerializeToString())
            if bad is None:  # served within its bounds, ended with a reason
                assert code == grpc.StatusCode.OK, details
                n = sum(len(c.token_ids) for c in chunks)
                assert 1 <= n <= req.sampling.max_tokens
                assert chunks[-1].finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
                assert n >= req.sampling.min_tokens  # no stop before min_tokens
            else:
                assert code == grpc.StatusCode.INVALID_ARGUMENT and bad in details, (bad, details)

        check()
    _finish(router, ledger, oracle, cluster)


def _req(**kw) -> generate_pb2.GenerateRequest:
    kw.setdefault("sampling", generate_pb2.SamplingParams(max_tokens=2))
    if "text" not in kw and "token_ids" not in kw and kw.pop("prompt", True):
        kw["token_ids"] = generate_pb2.TokenIds(ids=[1, 5, 6])
    return generate_pb2.GenerateRequest(**kw)


def _sp(**kw) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(max_tokens=2, **kw)


STATED = [  # (request, the status, a word its message must hold)
    (_req(prompt=False), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (_req(token_ids=generate_pb2.TokenIds()), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (_req(text=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (
        _req(token_ids=generate_pb2.TokenIds(ids=[1] * MAX_MODEL_LEN)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_model_len",
    ),
    (_req(text="x" * 100_000), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
    (_req(text="y" * (9 * 2**20)), grpc.StatusCode.INVALID_ARGUMENT, "bytes"),
    (
        _req(token_ids=generate_pb2.TokenIds(ids=[1, VOCAB])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "vocab",
    ),
    (_req(sampling=_sp(temperature=float("nan"))), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (_req(sampling=_sp(temperature=-1.0)), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (_req(sampling=_sp(top_p=0.0)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (_req(sampling=_sp(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (
        _req(sampling=generate_pb2.SamplingParams(max_tokens=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens",
    ),
    (
        _req(sampling=_sp(stop_token_ids=[VOCAB + 7])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "stop_token_ids",
    ),
    (_req(sampling=_sp(min_tokens=3)), grpc.StatusCode.INVALID_ARGUMENT, "min_tokens"),
    (
        _req(sampling=_sp(logit_bias={VOCAB: 1.0})),
        grpc.StatusCode.INVALID_ARGUMENT,
        "logit_bias",
    ),
    (
        _req(sampling=_sp(logit_bias={5: 101.0})),
        grpc.StatusCode.INVALID_ARGUMENT,
        "[-100, 100]",
    ),
    (
        _req(sampling=_sp(logit_bias={t: 1.0 for t in range(301)})),
        grpc.StatusCode.INVALID_ARGUMENT,
        "at most 300",
    ),
    (_req(request_id="r" * 300), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (_req(request_id="bad\nid"), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
]


def test_stated_refusals_then_still_serving(router, cluster, oracle):
    ledger = Ledger("stated", router_outcomes(router[1]))
    with grpc.insecure_channel(
        router[0], options=[("grpc.max_send_message_length", 64 * 2**20)]
    ) as channel:
        for req, code, word in STATED:
            got, _, details = _send(channel, ledger, req.SerializeToString())
            assert (got, word in details) == (code, True), (str(req)[:80], got, details)
    _finish(router, ledger, oracle, cluster)
