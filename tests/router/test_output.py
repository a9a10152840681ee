"""The router's text side, without any process: stop strings held back across tokens, released
when a worker or an Abort ends the request, and usage on the last chunk only."""

from __future__ import annotations

import asyncio

from splitserve.protos import generate_pb2
from splitserve.router.config import RouterConfig
from splitserve.router.intake import ModelInfo, prepare
from splitserve.router.output import OutputStream


def _stream(model_dir, **sampling) -> tuple[OutputStream, int]:
    cfg = RouterConfig(model_path=str(model_dir), max_model_len=256)
    model = ModelInfo.load(cfg)
    til = model.tokenizer.encode("til", add_special_tokens=False)
    assert len(til) == 1 and model.tokenizer.decode(til) == "til"
    req = asyncio.run(
        prepare(
            generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[1, 50, 60, 70]),
                sampling=generate_pb2.SamplingParams(temperature=0, **sampling),
            ),
            model,
            cfg,
        )
    )
    return OutputStream(model, req), til[0]


def test_held_stop_prefix_is_released_by_the_next_token_or_by_an_abort(tiny_llama):
    out, til = _stream(tiny_llama, max_tokens=10, stop=["tilX"])
    first = out.add([til])
    assert first.text == "" and list(first.token_ids) == [til]  # "til" may start "tilX": held back
    second = out.add([til])
    assert second.text == "til" and not second.HasField("usage")  # "tiltil": the first is safe now
    last = out.end(None, generate_pb2.FINISH_REASON_ABORT)
    assert last.text == "til" and last.finish_reason == generate_pb2.FINISH_REASON_ABORT
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 2) and out.finished


def test_stop_string_inside_a_chunk_drops_the_tokens_after_it(tiny_llama):
    out, til = _stream(tiny_llama, max_tokens=10, stop=["ilt"])
    chunk = out.add([til, til, til])  # "tilt" matches at the second token; the third is dropped
    assert list(chunk.token_ids) == [til, til] and chunk.text == "t"
    assert (
        chunk.finish_reason == generate_pb2.FINISH_REASON_STOP
        and chunk.stop_reason.stop_str == "ilt"
    )
    assert chunk.usage.completion_tokens == 2
