"""Every Python package folder of the project ships in a (non-editable) wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = {pkg: ROOT / folder for pkg, folder in cfg["package-dir"].items()}
    assert listed == set(dirs), "packages and package-dir must name the same packages"
    for pkg, folder in dirs.items():
        for init in folder.rglob("__init__.py"):
            sub = init.parent.relative_to(folder).parts
            name = ".".join((pkg, *sub))
            assert name in listed, (
                f"{init.parent} is a package but {name!r} is not in pyproject's packages"
            )
