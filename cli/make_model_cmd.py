"""`splitserve make-model --preset tiny DIR`: write a deterministic random checkpoint."""

from __future__ import annotations

import argparse

from tqdm import tqdm


def register(sub) -> None:
    from splitserve.cli.presets import PRESETS

    p = sub.add_parser(
        "make-model", help="write a deterministic random checkpoint + tokenizer into DIR"
    )
    p.add_argument("folder", metavar="DIR")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-shard-gib", type=float, default=2.0, help="split weights into shards of this size"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from splitserve.cli.make_model import make_model

    with tqdm(total=0, desc=f"writing {args.preset}", unit="tensor", disable=None) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        folder = make_model(
            args.preset,
            args.folder,
            seed=args.seed,
            max_shard_bytes=int(args.max_shard_gib * 2**30),
            progress=progress,
        )
    print(f"wrote {args.preset} checkpoint to {folder}")
    return 0
