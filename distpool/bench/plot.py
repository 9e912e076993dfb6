"""One PNG of a benchmark: p50 and p99 TTFT and TPOT, and SLO attainment, against the request rate,
a line per deployment (finite rates only). matplotlib is imported here, only when a plot is asked."""

from __future__ import annotations

import math

PANELS = (  # two rows of three, the last one left empty
    ("median_ttft_ms", "TTFT p50 (ms)"),
    ("p99_ttft_ms", "TTFT p99 (ms)"),
    ("slo_attainment", "SLO attainment"),
    ("median_tpot_ms", "TPOT p50 (ms)"),
    ("p99_tpot_ms", "TPOT p99 (ms)"),
)


def require_matplotlib() -> None:
    """ValueError with the fix when matplotlib is missing (checked before any run starts)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed. Fix: pip install 'distpool[bench]' "
            "(or matplotlib), or drop --plot"
        ) from None


def plot_runs(runs: dict[str, dict[float, dict]], path: str, title: str) -> None:
    """`runs`: deployment name -> rate -> that run's figures (distpool.bench.metrics)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 3, figsize=(13, 7))
    axes = grid.flat
    grid[1, 2].axis("off")
    for ax, (key, label) in zip(axes, PANELS, strict=False):
        for name, by_rate in runs.items():
            points = [
                (r, f[key]) for r, f in sorted(by_rate.items()) if math.isfinite(r) and f.get(key) is not None
            ]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        if key == "slo_attainment":
            ax.set_ylim(0, 1.05)
            ax.axhline(0.9, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    grid[0, 0].legend()
    if any(not math.isfinite(r) for by_rate in runs.values() for r in by_rate):
        title += " (rate inf not drawn)"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
