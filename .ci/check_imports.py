"""Runs import-linter's contracts (pyproject.toml [tool.importlinter]) on the installed layout.

The package is assembled from top-level folders by [tool.setuptools.package-dir], which
import-linter's file walk cannot follow, so the folders are copied into a temporary
`splitserve/` tree first (every package folder given an __init__.py there) and the contracts
run against that copy. Exit status: lint-imports'.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def assemble(dest: Path) -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in cfg.items():
        target = dest.joinpath(*package.split("."))
        for src in (ROOT / folder).glob("*.py"):
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target / src.name)
        target.mkdir(parents=True, exist_ok=True)
        (target / "__init__.py").touch()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="splitserve-imports-") as tmp:
        assemble(Path(tmp))
        shutil.copy2(ROOT / "pyproject.toml", Path(tmp) / "pyproject.toml")
        env = {**os.environ, "PYTHONPATH": tmp}
        lint = Path(sys.executable).with_name("lint-imports")
        return subprocess.run(
            [str(lint) if lint.exists() else "lint-imports", "--no-cache"], cwd=tmp, env=env
        ).returncode


if __name__ == "__main__":
    sys.exit(main())
