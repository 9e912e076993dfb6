"""The run's report (`serving.summary.report`) printed as a table: one row per figure, then each worker's
pages and slots, then the first errors. A figure that could not be read prints as "?" or says why."""

from __future__ import annotations

from distpool.serving.summary.report import TTFT_PARTS
from distpool.serving.summary.worker_reading import ALIVE


def _known(value: int | None) -> str:
    return "?" if value is None else str(value)


def _lost(report: dict) -> str:
    why = "; ".join(f"{name}: {reason}" for name, reason in sorted(report["workers_lost_why"].items()))
    return f"{report['workers_lost']} / {report['workers_restarted']}" + (f" ({why})" if why else "")


def _leaks(report: dict) -> str:
    unchecked = report["leaks_unchecked"]
    if not unchecked:
        return f"{report['leaked_pages']} / {report['leaked_slots']}"
    why = ", ".join(f"{name}: {reason}" for name, reason in sorted(unchecked.items()))
    return f"unknown (not read: {why})"


def _by_reason(count: int, reasons: dict[str, int]) -> str:
    words = ", ".join(f"{kind} {n}" for kind, n in reasons.items())
    return f"{count}" + (f" ({words})" if words else "")


def _failed(report: dict) -> str:
    return _by_reason(report["failed"], report["failures_by_reason"])


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _conversation_rows(multi_turn: dict | None) -> list[tuple[str, str]]:
    if multi_turn is None:
        return []
    m = multi_turn
    return [
        ("conversations completed / all", f"{m['conversations_completed']} / {m['conversations']}"),
        ("turns completed / planned", f"{m['turns_completed']} / {m['turns_planned']}"),
        ("turns skipped after a failure", str(m["turns_skipped"])),
        ("turns cut by the context", f"{m['turns_cut_by_context']} of {m['turns_asked']} asked"),
    ]


def _local(report: dict) -> str:
    kept, refused = report["decode_state_checkpoints"], report["local_prefill_fallbacks"]
    return (
        f"{report['local_prefills']} / {report['local_prefill_tokens']} "
        f"({kept} states kept, {refused} refused: {report['stale_view_refusals']} on a stale view, "
        f"{report['refusals_news_in_flight']} on news in flight)"
    )


def _by_path(report: dict, key: str, spec: str) -> str:
    """Each path's p50; "-" for a path no request took."""
    p50s = (report[key][path]["p50"] for path in ("remote", "local"))
    return " / ".join("-" if p50 is None else format(p50, spec) for p50 in p50s) + " ms"


def _deployment(report: dict) -> str:
    if report.get("deployment") == "colocated":
        return f"colocated: {report['decode_workers']} workers prefilling their own requests"
    return f"{report.get('prefill_workers', 1)}P{report.get('decode_workers', 1)}D"


def _rate(gbps: float) -> str:
    """A transfer rate, in MB/s below 0.1 GB/s: small envelopes move at a few MB/s, not at "0.00 GB/s"."""
    return f"{gbps:.2f} GB/s" if gbps >= 0.1 else f"{gbps * 1e3:.2f} MB/s"


def _tp_rows(report: dict) -> list[tuple[str, str]]:
    """Past TP 1: the TP sizes, and what each decode rank received."""
    if report["prefill_tp"] == report["decode_tp"] == 1:
        return []
    received = " / ".join(_mib(b) for b in report["transfer_bytes_by_rank"]) or "-"
    return [
        ("TP prefill : decode", f"{report['prefill_tp']} : {report['decode_tp']}"),
        ("  received per decode rank", received),
    ]


def format_summary(report: dict) -> str:
    breakdown = report["ttft_breakdown_ms"]
    verified = (
        f"{report['verified_envelopes']} / {report['corrupt_envelopes']}"
        if report["model_impl"] == "synthetic"
        else f"- ({report['model_impl']}: parity instead)"
    )
    utilization = (
        f"{_rate(report['transfer_gbps'])} / {_rate(report['link_gbps'])} = {report['link_utilization']:.2f} "
        f"(raw: {_mib(report['link_message_bytes'])} messages)"
    )
    rows = [
        ("deployment", _deployment(report)),
        ("model implementation", f"{report['model_impl']}, {report['dtype']}"),
        ("requests", report["requests"]),
        *([("interrupted: not finished", report["unfinished"])] if report["interrupted"] else []),
        ("completed", report["completed"]),
        ("failed", _failed(report)),
        ("retried", _by_reason(report["retried"], report.get("retries_by_reason", {}))),
        *_conversation_rows(report.get("multi_turn")),
        ("workers lost / restarted", _lost(report)),
        (
            "parity checked / mismatches",
            f"{report['parity_checked']} / {report['parity_mismatches']}"
            f" ({report['parity_near_ties']} near ties)",
        ),
        ("envelopes verified / corrupt", verified),
        ("TTFT p50 / p99 (ms)", f"{report['ttft_ms_p50']:.1f} / {report['ttft_ms_p99']:.1f}"),
        *(
            (f"  {part.replace('_', ' ')}", f"{breakdown[part]['p50']:.1f} / {breakdown[part]['p99']:.1f}")
            for part in TTFT_PARTS
        ),
        ("per-token p50 / p99 (ms)", f"{report['tpot_ms_p50']:.2f} / {report['tpot_ms_p99']:.2f}"),
        (
            "moved per request p50 / max",
            f"{_mib(report['transfer_bytes_p50'])} / {_mib(report['transfer_bytes_max'])}",
        ),
        (
            "byte runs p50 / max",
            f"{report['runs_per_envelope_p50']:.0f} / {report['runs_per_envelope_max']:.0f}",
        ),
        ("transfer", f"{_mib(report['transfer_bytes'])} at {_rate(report['transfer_gbps'])}"),
        *_tp_rows(report),
        (
            "prompt tokens hit / computed",
            f"{report['prefix_hit_tokens']} / {report['prefill_tokens_computed']}",
        ),
        ("prompt tokens held at decode", str(report["decode_prefix_hit_tokens"])),
        ("cached pages / checkpoints", f"{report['cached_pages']} / {report['checkpoints']}"),
        ("cache evictions", str(report["evictions"])),
        ("local prefills / tokens", _local(report)),
        ("TTFT p50 remote / local", _by_path(report, "ttft_ms_by_path", ".1f")),
        ("per-token p50 remote / local", _by_path(report, "tpot_ms_by_path", ".2f")),
        ("transfer / raw link", utilization),
        ("tokens generated", f"{report['tokens_generated']} in {report['wall_s']:.1f} s"),
        ("finished at stop / length", "{stop} / {length}".format(**report["finish_reasons"])),
        ("leaked pages / slots", _leaks(report)),
    ]
    width = max(len(k) for k, _ in rows)
    title = "colocated" if report.get("deployment") == "colocated" else "PD"
    lines = ["", f"distpool {title} run summary", "-" * (width + 40)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("-" * (width + 40))
    lines.append(f"{'worker':<12}{'pages used/peak/cap':>24}{'slots used/peak/cap':>24}{'cached/ckpts':>14}")
    for s in report["workers"]:
        pages = "/".join(_known(s[f"pages_{what}"]) for what in ("used", "peak", "capacity"))
        slots = "/".join(_known(s[f"slots_{what}"]) for what in ("used", "peak", "capacity"))
        cached = f"{_known(s.get('cached_pages'))}/{_known(s.get('checkpoints'))}"
        state = f"  ({s['state']})" if s["state"] != ALIVE else ""
        lines.append(f"{s['name']:<12}{pages:>24}{slots:>24}{cached:>14}{state}")
    for error in report["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
