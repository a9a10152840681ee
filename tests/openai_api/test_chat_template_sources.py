"""Where the chat template comes from and which one renders, against transformers'
AutoTokenizer.apply_chat_template as the oracle: chat_template.jinja (what transformers 5
save_pretrained writes) and additional_chat_templates/ replace tokenizer_config.json's entry,
chat_template.json is the last resort, a named template list picks `tool_use` when tools are
passed; every special token (unk/pad/sep/..., image_token) reaches the template, None-valued
message keys are dropped, reasoning is aliased, and namespace refuses _names. Through the HTTP
router: a chat_template.jinja-only checkpoint serves chat, and raise_exception is a 400; a model
without any chat template is a 400 that says so, and /health is 503 without workers."""

from __future__ import annotations

import asyncio
import json
import shutil

import grpc
import openai
import pytest
from openai_helpers import http, router_without_workers

from splitserve.request.errors import RequestError
from splitserve.request.tokenizer import Tokenizer
from splitserve.router.chat_template import render_chat

# bos/eos, tools as JSON, namespace, loop controls, {% generation %}, trim, add_generation_prompt,
# strftime_now
T_MAIN = (
    "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m.role == 'skip' %}{% continue %}{% endif %}<|{{ m.role }}|>{{ m.content | trim }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}n={{ ns.n }}"
    "{{ strftime_now('%Y') }}"
)
T_CONFIG = "CONFIG{% for m in messages %}{{ m.content }}{% endfor %}"
T_TOOL_USE = "TOOL_USE {{ tools | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
T_NAMED = [
    {"name": "default", "template": "DEFAULT{% for m in messages %}{{ m.content }}{% endfor %}"},
    {"name": "tool_use", "template": T_TOOL_USE},
]
TOOLS = [
    {"type": "function", "function": {"name": "wetter", "description": "Köln", "parameters": {}}}
]
MSGS = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "  hi  "},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "again"},
]


def checkpoint(base, folder, config_template=None, jinja=None, extra=None, legacy=None, **cfg):
    """A tokenizer folder: base's tokenizer.json, its config with `config_template` as the
    chat_template entry (None: no entry) and `cfg` merged, plus the template files given."""
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(base / name, folder / name)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if config_template is not None:
        config["chat_template"] = config_template
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **cfg}))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    for name, text in (extra or {}).items():
        (folder / "additional_chat_templates").mkdir(exist_ok=True)
        (folder / "additional_chat_templates" / f"{name}.jinja").write_text(text)
    if legacy is not None:
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": legacy}))
    return folder


def oracle(folder, messages, tools=None, **kwargs):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    return hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )


LAYOUTS = {
    "jinja_file_only": dict(jinja=T_MAIN),
    "jinja_file_beats_config": dict(jinja=T_MAIN, config_template=T_CONFIG),
    "jinja_plus_tool_use_file": dict(jinja=T_MAIN, extra={"tool_use": T_TOOL_USE}),
    "named_list_in_config": dict(config_template=T_NAMED),
    "config_string": dict(config_template=T_MAIN),
    "config_beats_legacy_json": dict(config_template=T_CONFIG, legacy=T_MAIN),
}


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_template_source_and_choice_match_transformers(tiny_llama, tmp_path, layout, tools):
    folder = checkpoint(tiny_llama, tmp_path / layout, **LAYOUTS[layout])
    got = render_chat(Tokenizer.from_dir(folder), MSGS, "m", tools)
    assert got == oracle(folder, MSGS, tools)


def test_chat_template_json_is_the_last_resort(tiny_llama, tmp_path):
    # AutoTokenizer ignores it (AutoProcessor reads it, and vLLM asks the processor next)
    folder = checkpoint(tiny_llama, tmp_path / "legacy", legacy=T_MAIN)
    assert render_chat(Tokenizer.from_dir(folder), MSGS, "m") == oracle(
        folder, MSGS, chat_template=T_MAIN
    )
    (folder / "chat_template.json").write_text('{"template": "x"}')
    with pytest.raises(ValueError, match="chat_template.json"):
        Tokenizer.from_dir(folder)


def test_a_template_name_is_picked_as_transformers_picks_it(tiny_llama, tmp_path):
    folder = checkpoint(tiny_llama, tmp_path / "named", config_template=T_NAMED)
    tok = Tokenizer.from_dir(folder)
    assert render_chat(tok, MSGS, "m", TOOLS, template_name="default") == oracle(
        folder, MSGS, TOOLS, chat_template="default"
    )
    with pytest.raises(RequestError) as info:
        render_chat(tok, MSGS, "m", template_name="rag")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'rag'" in info.value.message and "['default', 'tool_use']" in info.value.message


def test_templates_without_a_default_need_tools(tiny_llama, tmp_path):
    # the files replace the config's entry even when only additional_chat_templates/ exists
    folder = checkpoint(
        tiny_llama,
        tmp_path / "tools_only",
        config_template=T_CONFIG,
        extra={"tool_use": T_TOOL_USE},
    )
    tok = Tokenizer.from_dir(folder)
    assert render_chat(tok, MSGS, "m", TOOLS) == oracle(folder, MSGS, TOOLS)
    with pytest.raises(ValueError, match="no default"):
        oracle(folder, MSGS)
    with pytest.raises(RequestError) as info:
        render_chat(tok, MSGS, "m")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'default'" in info.value.message and "['tool_use']" in info.value.message


def test_no_template_names_every_place_looked(tiny_llama, tmp_path):
    tok = Tokenizer.from_dir(checkpoint(tiny_llama, tmp_path / "none"))
    with pytest.raises(RequestError) as info:
        render_chat(tok, MSGS, "m")
    message = info.value.message
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "no chat_template" in message
    for place in (
        "chat_template.jinja",
        "additional_chat_templates/",
        "tokenizer_config.json",
        "chat_template.json",
    ):
        assert place in message


def test_every_special_token_reaches_the_template(tiny_llama, tmp_path):
    names = ("bos", "eos", "unk", "pad", "sep", "cls", "mask", "image", "audio", "boi", "odd")
    template = "|".join(f"{n}={{{{ {n}_token }}}}" for n in names)
    added = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False}
    added |= {"rstrip": False, "single_word": False, "special": True}
    folder = checkpoint(
        tiny_llama,
        tmp_path / "tokens",
        jinja=template,
        sep_token="</s>",
        cls_token=added,
        image_token="<pad>",  # a model-specific *_token entry
        boi_token=added,
        odd_token=5,  # not a token: no variable
        extra_special_tokens={"audio_token": "<unk>"},
    )
    got = render_chat(Tokenizer.from_dir(folder), MSGS, "m")
    assert got == oracle(folder, MSGS)
    assert "unk=<unk>|pad=<pad>|sep=</s>|cls=<s>|mask=|image=<pad>|audio=<unk>|boi=<s>" in got


def test_messages_are_normalized_as_transformers_does(tiny_llama, tmp_path):
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content if m.content is defined else '-' }}"
        "[{{ m.reasoning_content }}/{{ m.thinking }}]{{ m.name }};{% endfor %}"
        "{{ dict.fromkeys(['a'], 1) }}{{ dict(b=2) }}"
    )
    folder = checkpoint(tiny_llama, tmp_path / "norm", jinja=template)
    messages = [
        {"role": "user", "content": "q", "name": None},
        {"role": "assistant", "content": None, "reasoning": "think"},
        {"role": "assistant", "content": "a", "thinking": "t2"},
    ]
    assert render_chat(Tokenizer.from_dir(folder), messages, "m") == oracle(folder, messages)


def test_namespace_refuses_underscore_names(tiny_llama, tmp_path):
    folder = checkpoint(
        tiny_llama, tmp_path / "ns", jinja="{% set ns = namespace(_x=1) %}{{ ns._x }}"
    )
    with pytest.raises(Exception, match="underscore"):
        oracle(folder, MSGS)
    with pytest.raises(RequestError) as info:
        render_chat(Tokenizer.from_dir(folder), MSGS, "m")
    assert (
        info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "underscore" in info.value.message
    )


def test_jinja_only_checkpoint_serves_chat_and_refusals_are_400s(tiny_llama, tmp_path):
    strict = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}"
        "{% endif %}" + T_MAIN
    )
    folder = checkpoint(tiny_llama, tmp_path / "jinja-only", jinja=strict)

    async def body():
        async with router_without_workers(folder) as router:
            base = f"http://{router.http.address}/v1"
            async with openai.AsyncOpenAI(base_url=base, api_key="-", max_retries=0) as c:
                with pytest.raises(openai.BadRequestError) as refused:
                    await c.chat.completions.create(model="jinja-only", messages=MSGS[1:])
                # rendered fine; it fails only for want of a worker
                with pytest.raises(openai.InternalServerError) as rendered:
                    await c.chat.completions.create(model="jinja-only", messages=MSGS)
            return refused.value, rendered.value

    refused, rendered = asyncio.run(body())
    assert refused.status_code == 400 and refused.body["param"] == "messages"
    assert "first message must be system" in refused.body["message"]
    assert rendered.status_code == 503 and rendered.body["code"] == "unavailable"


def test_model_without_chat_template_is_a_400_and_health_503_without_workers(tiny_llama, tmp_path):
    folder = checkpoint(tiny_llama, tmp_path / "no-template")  # no template anywhere
    hello = [{"role": "user", "content": "Hello"}]

    async def body():
        async with router_without_workers(folder) as router:
            base = f"http://{router.http.address}"
            async with openai.AsyncOpenAI(
                base_url=base + "/v1", api_key="unused", max_retries=0
            ) as c:
                with pytest.raises(openai.BadRequestError) as no_template:
                    await c.chat.completions.create(model="no-template", messages=hello)
                with pytest.raises(openai.InternalServerError) as no_workers:
                    await c.completions.create(model="no-template", prompt="Hi", max_tokens=2)
            health = await asyncio.to_thread(http, "GET", base + "/health")
            return no_template.value, no_workers.value, health, router.describe()

    no_template, no_workers, (status, health, _), described = asyncio.run(body())
    assert (
        no_template.body["param"] == "messages"
        and "no chat_template" in no_template.body["message"]
    )
    assert "/v1/completions" in no_template.body["message"]
    assert no_workers.status_code == 503 and no_workers.body["code"] == "unavailable"
    assert status == 503 and health["status"] == "unavailable" and health["healthy_decode"] == 0
    assert "OpenAI HTTP API on http://127.0.0.1:" in described
