"""--plot FILE.png: the CDF of each latency metric (TTFT, TPOT, ITL, E2E), one panel each.

matplotlib is optional: `require_matplotlib()` is called before the benchmark runs, so a
missing install is one line up front, not a failure after the run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from splitserve.cli.bench.metrics import METRICS
from splitserve.cli.bench.report import NAMES


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or leave --plot out)"
        ) from None


def plot_cdfs(path: str | Path, samples: dict[str, list[float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for ax, metric in zip(axes.flat, METRICS):
        values = np.sort(np.asarray(samples[metric], dtype=np.float64))
        ax.set_title(NAMES[metric], fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if not len(values):
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
        for q, style in ((50, ":"), (99, "--")):
            ax.axvline(
                np.percentile(values, q), color="gray", linestyle=style, linewidth=1, label=f"p{q}"
            )
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
