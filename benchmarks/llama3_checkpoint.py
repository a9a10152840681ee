"""A checkpoint with Llama 3's real 128,256-token tokenizer for the structured-output benchmark
(`decode.py --constrained --model-dir OUT`): the weights of an existing checkpoint of that
vocabulary size (the `llama-3.2-1b` preset: linked, not copied), Llama 3's tokenizer.json built
from its tiktoken file (bench_vocab.llama3_tokenizer: how to get the 2 MB file) and Llama 3's
special ids in the configs (bos 128000, eos <|eot_id|> 128009). Runs offline in seconds.

    splitserve make-model --preset llama-3.2-1b /tmp/l1b
    python benchmarks/llama3_checkpoint.py /tmp/l1b llama_models/llama3/tokenizer.model /tmp/l1b3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vocab import LLAMA3_EOS, llama3_tokenizer  # noqa: E402

LLAMA3_BOS = 128000


def make(src: Path, tiktoken_file: Path, out: Path) -> Path:
    cfg = json.loads((src / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    _, vocab, eos = llama3_tokenizer(tiktoken_file, out)
    if cfg["vocab_size"] != vocab:
        raise SystemExit(f"{src} has a vocabulary of {cfg['vocab_size']}; Llama 3's is {vocab}")
    for f in src.iterdir():
        if f.suffix == ".safetensors" or f.name == "model.safetensors.index.json":
            link = out / f.name
            if not link.exists():
                os.symlink(f.resolve(), link)
    ids = {"bos_token_id": LLAMA3_BOS, "eos_token_id": eos}
    (out / "config.json").write_text(json.dumps({**cfg, **ids}, indent=2))
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2))
    tok_cfg_file = src / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_file.read_text()) if tok_cfg_file.is_file() else {}
    tok_cfg |= {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    tok_cfg |= {"unk_token": None, "pad_token": None}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    assert eos == LLAMA3_EOS
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("checkpoint", type=Path, help="a checkpoint of 128,256 tokens (weights)")
    p.add_argument("tiktoken_file", type=Path, help="llama_models/llama3/tokenizer.model")
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    print(f"wrote {make(args.checkpoint, args.tiktoken_file, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
