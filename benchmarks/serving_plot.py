"""serving_compare.py --plot FILE.png: DistServe's figure. Four panels against the request rate:
goodput, SLO attainment (the 90 % line marked), TTFT p99 and ITL p99; one line per mode, the
median over repeats with bars from the smallest to the largest repeat.

matplotlib is optional: `require_matplotlib()` runs before anything starts, so a missing install
is one line up front, not a failure after the sweep.
"""

from __future__ import annotations

from pathlib import Path

PANELS = (
    ("goodput", "goodput (req/s)"),
    ("slo_attainment", "requests within the SLO"),
    ("ttft_p99_ms", "TTFT p99 (ms)"),
    ("itl_p99_ms", "ITL p99 (ms)"),
)


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or leave --plot out)"
        ) from None


def plot_sweep(path: str | Path, doc: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    modes = sorted({e["mode"] for e in doc["sweep"]}, reverse=True)  # disaggregated first
    for ax, (figure, label) in zip(axes.flat, PANELS):
        for mode in modes:
            rows = [e for e in doc["sweep"] if e["mode"] == mode and e.get(figure) is not None]
            rates = [e["rate"] for e in rows]
            mid = [e[figure] for e in rows]
            low = [m - e["spread"][figure]["min"] for m, e in zip(mid, rows)]
            high = [e["spread"][figure]["max"] - m for m, e in zip(mid, rows)]
            line = ax.errorbar(rates, mid, yerr=[low, high], marker="o", capsize=3, label=mode)
            sustainable = doc["sustainable_rate"].get(mode)
            if sustainable:
                ax.axvline(sustainable, color=line[0].get_color(), linestyle=":", linewidth=1)
        if figure == "slo_attainment":
            ax.axhline(doc["slo_target"], color="gray", linestyle="--", linewidth=1)
            ax.set_ylim(0, 1.05)
        elif figure != "goodput":
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        rates = sorted({e["rate"] for e in doc["sweep"]})
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    slo = doc["config"].get("slo", "")
    sus = ", ".join(f"{m} {r:g}" for m, r in doc["sustainable_rate"].items())
    fig.suptitle(
        f"{doc['gpus']} GPU(s), {doc['config'].get('workload')} traffic, SLO {slo}; "
        f"sustainable req/s (dotted): {sus}",
        fontsize=10,
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    """`python benchmarks/serving_plot.py SWEEP.json OUT.png`: the figure of a finished sweep,
    drawn where matplotlib is installed (the GPU machine may lack it)."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("sweep_json")
    p.add_argument("png")
    args = p.parse_args(argv)
    try:
        require_matplotlib()
        doc = json.loads(Path(args.sweep_json).read_text())
    except (ValueError, OSError) as exc:
        print(f"serving_plot.py: error: {exc}", file=sys.stderr)
        return 2
    plot_sweep(args.png, doc)
    print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
