"""`splitserve complete "prompt"`: prefill + decode in this process (no services); the
single-process reference path. Without --model it uses the embedded tiny model."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "complete", help="generate text for a prompt in-process (no router or workers)"
    )
    p.add_argument("prompt")
    p.add_argument(
        "--model", default=None, help="checkpoint folder (default: the embedded tiny model)"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from splitserve.cli.tiny_model_cache import default_model_dir
    from splitserve.config.engine_config import EngineConfig
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.offline import OfflineEngine
    from splitserve.request.sampling_params import SamplingParams
    from splitserve.request.tokenizer import Tokenizer

    model_dir = args.model or str(default_model_dir())
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    runner = ModelRunner(EngineConfig(model_path=model_dir, device=args.device))
    tok = Tokenizer.from_dir(model_dir)
    engine = OfflineEngine(runner, tok)
    [done] = engine.generate([tok.encode(args.prompt)], [params])
    sys.stdout.write(args.prompt + done.text + "\n")
    print(f"[{len(done.token_ids)} tokens, finish_reason={done.finish_reason}]", file=sys.stderr)
    return 0
