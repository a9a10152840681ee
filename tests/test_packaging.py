"""Packaging: every folder of Python modules ships as a listed package, and no top-level folder
can shadow a published package of the same name when the repository root is on sys.path (as
`python -m pytest` puts it): the mapped folders are namespace packages, without __init__.py."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
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


def _installs(text: str) -> list[list[str]]:
    """Each `pip install ...` in text (to the next `&&` or line end), -q and the pip upgrade left out."""
    found = [shlex.split(m) for m in re.findall(r"pip install ([^&\n]+)", text)]
    return [[a for a in args if a != "-q"] for args in found if args[-2:] != ["--upgrade", "pip"]]


def test_ucx_comes_from_an_extra_that_the_set_up_installs():
    """The base dependencies pin no CUDA-specific UCX; the cuNN extras do. The README's two
    commands install an extra that brings ucxx, and .ci/run runs the README's set-up exactly."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if re.match(r"(lib)?ucx", d)]
    extras = project["optional-dependencies"]
    for cuda in ("cu12", "cu13"):
        assert [re.split(r"[<>=!~ ]", d)[0] for d in extras[cuda]] == [f"ucxx-{cuda}"]
    ucx_extras = {name for name, deps in extras.items() if any(d.startswith("ucxx") for d in deps)}
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2, "the README's two commands (run, test) start with python3 -m venv"
    for command in commands:
        (spec,) = [args[-1] for args in _installs(command) if args[:1] == ["-e"]]
        chosen = set(re.fullmatch(r"\.\[(.*)\]", spec).group(1).split(","))
        assert len(chosen & ucx_extras) == 1, f"{command!r} must install one UCX extra"
    ci_installs = _installs((ROOT / ".ci" / "run").read_text())
    assert ci_installs == _installs(commands[1]), ".ci/run must run the README's set-up"


def test_the_wheel_ships_every_module(tmp_path):
    """A built (non-editable) wheel: every module and .proto of the mapped folders under
    splitserve/, nothing at top level besides it, the version of pyproject in splitserve.version."""
    src = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the checkout
    folders = {Path(f).parts[0] for f in SETUPTOOLS["package-dir"].values()}
    for folder in folders:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*cmd, "-w", str(tmp_path), str(src)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("splitserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "/".join((*pkg.split("."), f.name))
        for pkg, folder in MAPPED.items()
        for f in folder.glob("*.py")
    } | {
        f"splitserve/protos/{p.relative_to(ROOT / 'protos')}"
        for p in ROOT.glob("protos/**/*.proto")
    }
    assert expected - names == set(), "the wheel misses these"
    assert {n.split("/")[0] for n in names} == {
        "splitserve",
        wheel.name.split("-py3")[0] + ".dist-info",
    }
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f'__version__ = "{version}"' in (ROOT / "splitserve_pkg" / "version.py").read_text()
