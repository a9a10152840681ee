"""Writes a small deterministic byte-level BPE tokenizer for the tiny test checkpoint.

Tests and the demo need a real tokenizer folder without downloading one. The tokenizer is
trained with `tokenizers`' BpeTrainer on a fixed embedded text: the trainer breaks ties
between equally frequent pairs by the pair itself and `Tokenizer.save` orders the vocab
by id, so the files are byte-identical on every run (a test writes twice and compares).
Layout mirrors Llama: `<unk>`=0, `<s>`=1 (bos), `</s>`=2 (eos), `<pad>`=3, then the 256
byte tokens, then merges. Like Llama-3, tokenizer.json carries a post-processor that adds
`<s>`; tokenizer_config.json also says `add_bos_token: true`, which gives the same result.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)
NUM_BYTES = 256

# A Llama-2-like template: the bos token is part of the template, so callers encode the
# rendered chat with add_special_tokens=False (as transformers' apply_chat_template does).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine takes a request, splits the
prompt into tokens, computes the key and value cache for every layer, and then samples one
token after another until the model writes an end of sequence token or reaches its limit.
Prefill workers handle long prompts in chunks; decode workers keep a running batch and
replay captured graphs so that each step costs little more than reading the weights once.
When a request is cancelled, every worker frees its blocks within one step, and the router
reports the reason to the client. Streaming text must never show a broken character: a
byte that starts a character waits until the bytes that complete it have arrived.
In the morning the market opened early; farmers brought apples, pears, cherries, onions,
carrots, potatoes, bread, cheese, honey and fresh flowers. Children played near the river
while their parents talked about the weather, the harvest, the price of wheat and the new
bridge that the town council had promised to build before the winter. Some people walked,
others rode bicycles, and a few drove old trucks loaded with wood, hay and barrels of wine.
Mathematics gives us numbers such as zero, one, two, three, four, five, six, seven, eight,
nine, ten, eleven, twelve, twenty, thirty, forty, fifty, hundred, thousand and million.
Questions: who, what, where, when, why, how? Answers are often simple; sometimes they are
not. Reading, writing, listening, speaking, thinking, learning, teaching, building, testing,
measuring, comparing and improving are the habits of good engineers everywhere.
def main(argv: list[str]) -> int:
    for index, value in enumerate(argv):
        if value == "--help":
            print("usage: serve [options]")
            return 0
    return 1
{"role": "user", "content": "Hello, how are you today?"}
{"role": "assistant", "content": "I am fine, thank you. How can I help?"}
Accents and other scripts: café, naïve, façade, résumé, jalapeño, über, smörgåsbord, Ångström,
crème brûlée, São Paulo, Kraków, Zürich. Привет, как дела? Γειά σου κόσμε. 你好，世界。
こんにちは、世界。 안녕하세요. مرحبا بالعالم. Numbers 0123456789, 3.14159, 2.71828, 1e-5, 42%.
Symbols: @ # $ % ^ & * ( ) [ ] { } < > / \\ | ~ ` + = - _ : ; ' " , . ! ?
The history of writing began with marks on clay and stone; later came paper, printing,
typewriters, computers, phones and the networks that connect them across oceans and
continents. Libraries collected books about astronomy, biology, chemistry, geography,
history, languages, medicine, music, philosophy, physics and the stories of ordinary lives.
A good test can fail: it checks one behaviour, names it clearly, runs quickly, and explains
what went wrong when the result differs from what was expected by the person who wrote it.
"""


def _build(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tok


def write_byte_level_tokenizer(folder: Path, vocab_size: int, model_max_length: int = 2048) -> None:
    """Write tokenizer.json and tokenizer_config.json for a vocab of exactly `vocab_size`.

    Raises ValueError when vocab_size is below the specials plus the 256 bytes, or above
    what the embedded text can provide merges for.
    """
    minimum = len(SPECIAL_TOKENS) + NUM_BYTES
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {minimum}"
        )
    tok = _build(vocab_size)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too large for the embedded training text "
            f"(it yields at most {got} tokens); use a smaller vocab_size"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2) + "\n", encoding="utf-8"
    )
