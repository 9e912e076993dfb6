"""The main job's summary: latency percentiles, transfer rate, occupancy and leaks."""

from __future__ import annotations

import math

from distpool.serving.driver import Outcome


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))  # the smallest rank covering q%
    return ordered[rank - 1]


def summarize(
    outcomes: list[Outcome],
    *,
    retried: int,
    worker_stats: list[dict],
    parity: tuple[int, int],
    wall_s: float,
    workers_lost: int = 0,
    workers_restarted: int = 0,
) -> dict:
    done = [o for o in outcomes if o.tokens is not None]
    ttft_ms = [o.ttft_s * 1e3 for o in done]
    tpot_ms = [o.decode_s * 1e3 / (len(o.tokens) - 1) for o in done if len(o.tokens) > 1]
    moved, seconds = sum(o.transfer_bytes for o in done), sum(o.transfer_s for o in done)
    return {
        "requests": len(outcomes),
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "retried": retried,
        "workers_lost": workers_lost,
        "workers_restarted": workers_restarted,
        "parity_checked": parity[0],
        "parity_mismatches": parity[1],
        "transfer_bytes": moved,
        "transfer_gbps": moved / seconds / 1e9 if seconds else 0.0,
        "ttft_ms_p50": percentile(ttft_ms, 50),
        "ttft_ms_p99": percentile(ttft_ms, 99),
        "tpot_ms_p50": percentile(tpot_ms, 50),
        "tpot_ms_p99": percentile(tpot_ms, 99),
        "tokens_generated": sum(len(o.tokens) for o in done),
        "wall_s": wall_s,
        # `worker_stats` is read after the run drained: anything still held belongs to no request.
        "leaked_pages": sum(s["pages_used"] for s in worker_stats),
        "leaked_slots": sum(s["slots_used"] for s in worker_stats),
        "workers": worker_stats,
        "errors": sorted({o.error for o in outcomes if o.tokens is None and o.error})[:10],
    }


def format_summary(report: dict) -> str:
    rows = [
        ("requests", report["requests"]),
        ("completed", report["completed"]),
        ("failed", report["failed"]),
        ("retried", report["retried"]),
        ("workers lost / restarted", f"{report['workers_lost']} / {report['workers_restarted']}"),
        ("parity checked / mismatches", f"{report['parity_checked']} / {report['parity_mismatches']}"),
        ("TTFT p50 / p99 (ms)", f"{report['ttft_ms_p50']:.1f} / {report['ttft_ms_p99']:.1f}"),
        ("per-token p50 / p99 (ms)", f"{report['tpot_ms_p50']:.2f} / {report['tpot_ms_p99']:.2f}"),
        ("transfer", f"{report['transfer_bytes'] / 2**20:.1f} MiB at {report['transfer_gbps']:.2f} GB/s"),
        ("tokens generated", f"{report['tokens_generated']} in {report['wall_s']:.1f} s"),
        ("leaked pages / slots", f"{report['leaked_pages']} / {report['leaked_slots']}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["", "distpool PD run summary", "-" * (width + 30)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("-" * (width + 30))
    lines.append(f"{'worker':<12}{'pages used/peak/cap':>24}{'slots used/peak/cap':>24}")
    for s in report["workers"]:
        pages = f"{s['pages_used']}/{s['pages_peak']}/{s['pages_capacity']}"
        slots = f"{s['slots_used']}/{s['slots_peak']}/{s['slots_capacity']}"
        dead = "  (dead)" if s.get("state") == "dead" else ""
        lines.append(f"{s['name']:<12}{pages:>24}{slots:>24}{dead}")
    for error in report["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
