"""The OpenAI front's pure parts, no process: chat templates render as transformers'
apply_chat_template renders them (sandbox, raise_exception, tojson, {% generation %}, special
tokens), gRPC statuses map to OpenAI's HTTP errors with the client's parameter names, and token
bytes are exact for byte-level BPE."""

from __future__ import annotations

import asyncio
import json
import shutil

import grpc
import pytest

from splitserve.request.errors import RequestError
from splitserve.request.tokenizer import Tokenizer
from splitserve.router.chat_template import chat_prompt_ids, render_chat
from splitserve.router.openai_errors import error_from_request_error, parse
from splitserve.router.openai_protocol import ChatCompletionRequest

# Llama-3's template shape: system message first, roles must alternate (raise_exception),
# {% generation %} marks the assistant's tokens, tojson of a non-ASCII value.
STRICT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set offset = 1 %}"
    "<<SYS>>{{ messages[0]['content'] | trim }}<</SYS>>\n{% else %}{% set offset = 0 %}{% endif %}"
    "{% for message in messages[offset:] %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}[INST] {{ message['content'] | tojson }} [/INST]{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "  Be brief. "},
        {"role": "user", "content": "Café, naïve?"},
        {"role": "assistant", "content": "Oui."},
        {"role": "user", "content": "你好"},
    ],
]


@pytest.fixture(scope="module")
def strict_model(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("strict_template")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_llama / name, folder / name)
    config = json.loads((tiny_llama / "tokenizer_config.json").read_text())
    config["chat_template"] = STRICT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("which", ["tiny", "strict"])
def test_templates_render_and_tokenize_as_transformers(tiny_llama, strict_model, which):
    from transformers import AutoTokenizer

    folder = tiny_llama if which == "tiny" else strict_model
    hf, ours = AutoTokenizer.from_pretrained(folder), Tokenizer.from_dir(folder)
    for messages in CONVERSATIONS:
        want_text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        want_ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want_ids = list(want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)
        assert render_chat(ours, messages, "m") == want_text
        assert asyncio.run(chat_prompt_ids(ours, messages, "m")) == want_ids


def test_template_refusals_are_400s(strict_model):
    tok = Tokenizer.from_dir(strict_model)
    with pytest.raises(RequestError) as info:
        render_chat(tok, [{"role": "assistant", "content": "first"}], "m")
    assert (
        info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        and "roles must alternate" in info.value.message
    )
    # the sandbox refuses attribute tricks
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(RequestError) as info:
        render_chat(tok, [{"role": "user", "content": "x"}], "m")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    tok.chat_template = "{% for %}"
    with pytest.raises(RequestError) as info:
        render_chat(tok, [{"role": "user", "content": "x"}], "m")
    assert info.value.code == grpc.StatusCode.INTERNAL and "does not compile" in info.value.message
    tok.chat_template = None
    with pytest.raises(RequestError) as info:
        render_chat(tok, [{"role": "user", "content": "x"}], "m")
    assert "no chat_template" in info.value.message


def test_text_parts_are_joined_for_the_template(tiny_llama):
    req = parse(
        ChatCompletionRequest,
        {
            "messages": [
                {
                    "role": "user",
                    "name": "ann",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        },
    )
    assert req.messages[0].as_template_input() == {"role": "user", "content": "a\nb", "name": "ann"}


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.ALREADY_EXISTS, 409),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.FAILED_PRECONDITION, 500),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_grpc_statuses_map_to_http(code, status):
    err = error_from_request_error(RequestError(code, "something"), {}, "prompt")
    assert err.status == status and err.code == code.name.lower()
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_shared_validation_messages_get_the_clients_parameter_names():
    names = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}
    err = error_from_request_error(
        RequestError.invalid("sampling.max_tokens = 0: too small"), names, "messages"
    )
    assert (err.param, err.message) == (
        "max_completion_tokens",
        "max_completion_tokens = 0: too small",
    )
    err = error_from_request_error(
        RequestError.invalid("sampling.logprobs = 30: no"), names, "messages"
    )
    assert err.param == "top_logprobs" and err.message.startswith("top_logprobs = 30")
    err = error_from_request_error(
        RequestError.invalid("token_ids.ids[2] = 9 is outside"), {}, "prompt"
    )
    assert (err.param, err.message) == ("prompt", "prompt[2] = 9 is outside")
    err = error_from_request_error(RequestError.invalid("text is empty; send text"), {}, "prompt")
    assert (err.param, err.message) == ("prompt", "prompt is empty; send text")


def test_token_bytes_are_exact_for_byte_level_bpe(tiny_llama):
    tok = Tokenizer.from_dir(tiny_llama)
    text = "Kraków 你好, café!"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_bytes(tok.eos_token_id) == b"</s>"
