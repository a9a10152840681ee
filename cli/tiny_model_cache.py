"""The embedded default model: the `tiny` preset, written on first use into a cache folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from splitserve.cli.make_model import make_model


def default_model_dir() -> Path:
    root = Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))
    folder = root / "models" / "tiny"
    if not (folder / "config.json").is_file():
        tmp = folder.with_name(f"tiny.tmp{os.getpid()}")
        make_model("tiny", tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
