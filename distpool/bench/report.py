"""The benchmark's printed results: a block per run, as `vllm bench serve` prints it, and the
deployments side by side, a row per rate."""

from __future__ import annotations

from distpool.bench.metrics import LATENCIES, percentile_name

LATENCY_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def format_run(title: str, figures: dict, percentiles: list[float]) -> str:
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value) -> None:
        text = "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", figures["completed"])
    row("Failed requests:", figures["failed"])
    row("Benchmark duration (s):", figures["duration"])
    row("Total input tokens:", figures["total_input_tokens"])
    row("Total generated tokens:", figures["total_output_tokens"])
    row("Request throughput (req/s):", figures["request_throughput"])
    row("Request goodput (req/s):", figures["request_goodput"])
    row("SLO attainment:", figures["slo_attainment"])
    row("Output token throughput (tok/s):", figures["output_throughput"])
    row("Total token throughput (tok/s):", figures["total_token_throughput"])
    for name in LATENCIES:
        lines.append(f"{' ' + LATENCY_TITLES[name] + ' ':-^60}")
        row(f"Mean {name.upper()} (ms):", figures[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", figures[f"median_{name}_ms"])
        for p in percentiles:
            key = percentile_name(p)
            row(f"P{key[1:]} {name.upper()} (ms):", figures[f"{key}_{name}_ms"])
    for error in figures["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)


TABLE_COLUMNS = (
    ("req/s", "request_throughput"),
    ("good/s", "request_goodput"),
    ("ttft p50", "median_ttft_ms"),
    ("ttft p99", "p99_ttft_ms"),
    ("tpot p50", "median_tpot_ms"),
    ("tpot p99", "p99_tpot_ms"),
    ("slo", "slo_attainment"),
)


def format_side_by_side(runs: dict[str, dict[float, dict]]) -> str:
    """One row per rate, one group of columns per deployment (milliseconds for latencies; a
    percentile not asked for with --percentiles shows as -)."""
    names = list(runs)
    rates = sorted({rate for by_rate in runs.values() for rate in by_rate})
    width = 9
    head = f"{'rate':>6} | " + " | ".join(f"{name:^{width * len(TABLE_COLUMNS)}}" for name in names)
    sub = f"{'req/s':>6} | " + " | ".join("".join(f"{c:>{width}}" for c, _ in TABLE_COLUMNS) for _ in names)
    lines = [head, sub, "-" * len(sub)]
    for rate in rates:
        cells = []
        for name in names:
            figures = runs[name].get(rate)
            values = [None if figures is None else figures.get(key) for _, key in TABLE_COLUMNS]
            cells.append("".join(f"{_cell(v):>{width}}" for v in values))
        lines.append(f"{rate:>6g} | " + " | ".join(cells))
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
