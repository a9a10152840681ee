"""Packaging: every folder of Python modules ships as a listed package, and no top-level folder
can shadow a published package of the same name when the repository root is on sys.path (as
`python -m pytest` puts it): the mapped folders are namespace packages, without __init__.py."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
MAPPED = {pkg: ROOT / folder for pkg, folder in SETUPTOOLS["package-dir"].items()}


def test_every_module_folder_is_a_listed_package():
    listed = set(SETUPTOOLS["packages"])
    assert listed == set(MAPPED), "packages and package-dir must name the same packages"
    for pkg, folder in MAPPED.items():
        for module in folder.rglob("*.py"):
            if "__pycache__" in module.parts:
                continue
            sub = module.parent.relative_to(folder).parts
            if sub and sub[0] == "splitserve":  # protos/splitserve/v1: .proto data, not modules
                continue
            name = ".".join((pkg, *sub))
            assert name in listed, f"{module} ships only if {name!r} is in pyproject's packages"


def test_no_top_level_folder_is_a_regular_package():
    inits = [folder / "__init__.py" for pkg, folder in MAPPED.items() if pkg.count(".") <= 1]
    assert not [p for p in inits if p.exists()], (
        "an __init__.py here makes the folder shadow its PyPI namesake"
    )


def test_bare_folder_names_do_not_resolve_to_the_repository_from_its_root():
    """`import kernels` from the root must find Hugging Face's kernels (transformers imports it),
    or at worst a namespace portion, never our folder as a regular package."""
    names = sorted(folder.name for pkg, folder in MAPPED.items() if pkg.count(".") == 1)
    code = (
        "import importlib.util, json, sys; out = {}\n"
        f"for n in {names!r}:\n"
        "    s = importlib.util.find_spec(n)\n"
        "    out[n] = s.origin if s is not None else None\n"
        "print(json.dumps(out))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    import json

    folders = [folder.resolve() for folder in MAPPED.values()]
    for name, origin in json.loads(run.stdout).items():
        ours = origin is not None and any(Path(origin).resolve().is_relative_to(f) for f in folders)
        assert not ours, f"`import {name}` resolves to our folder: {origin}"


def test_transformers_imports_from_the_repository_root():
    """The failure `python -m pytest` hit: transformers' optional `kernels` import."""
    code = "import transformers; from transformers import LlamaForCausalLM; print('ok')"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


def test_the_image_copies_every_package_folder():
    copied = {
        line.split()[1].rstrip("/")
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
    }
    folders = {
        Path(folder).name for folder in SETUPTOOLS["package-dir"].values() if "/" not in folder
    }
    assert folders <= copied, f"the Dockerfile misses {sorted(folders - copied)}"


def test_ucx_comes_from_an_extra_that_the_set_up_installs():
    """The base dependencies pin no CUDA-specific UCX; cu12 / cu13 extras do, and the README's
    two commands and .ci/run install one (cu12, which also runs on a CPU-only machine)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("ucxx")]
    extras = project["optional-dependencies"]
    assert extras["cu12"][0].startswith("ucxx-cu12") and extras["cu13"][0].startswith("ucxx-cu13")
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    assert "pip install -e '.[cu12]' && splitserve serve" in readme
    assert "pip install -e '.[test,cu12]' &&" in readme and "-e '.[test,cu12]'" in ci
