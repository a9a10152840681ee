"""Install weight of a grammar engine (grammar_engines.py --install-weight): the MB that `pip
install <requirement>` adds to a fresh venv under a temp dir, with its dependencies."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path


def _dist_sizes(site: Path) -> dict[str, int]:
    """Bytes on disk per installed distribution (its RECORD's files, as they are now)."""
    sizes = {}
    for info in site.glob("*.dist-info"):
        name, total = info.name.split("-")[0], 0
        record = info / "RECORD"
        if record.is_file():
            for line in record.read_text().splitlines():
                path = site / line.split(",")[0]
                if path.is_file():
                    total += path.stat().st_size
        sizes[name] = total
    return sizes


def _tree_bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def install_weight(requirement: str, workdir: Path) -> dict:
    venv = workdir / requirement.split("==")[0]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--upgrade", "pip"], check=True, capture_output=True)
    site = Path(
        subprocess.check_output(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        )
        .decode()
        .strip()
    )
    before_dists, before = set(_dist_sizes(site)), _tree_bytes(venv)
    t0 = time.perf_counter()
    done = subprocess.run([*pip, "install", requirement], capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1]}
    sizes = _dist_sizes(site)
    added = {k: v for k, v in sizes.items() if k not in before_dists}
    largest = sorted(added.items(), key=lambda kv: -kv[1])[:8]
    mb = round((_tree_bytes(venv) - before) / 2**20, 1)
    shutil.rmtree(venv, ignore_errors=True)
    return {
        "added_mb": mb,
        "distributions": len(added),
        "largest_mb": {k: round(v / 2**20, 1) for k, v in largest},
        "install_s": round(time.perf_counter() - t0, 1),
    }
