"""The main job's summary: latency percentiles and their breakdown, transfer rate against the raw
link, envelope sizes, verification, occupancy and leaks, assembled as the report `--json` writes
(`summarize`); `serving.summary.report_text` prints it."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

from distpool.serving.outcome import Outcome
from distpool.serving.summary.parity import Parity
from distpool.serving.summary.worker_reading import WorkerReading

TTFT_PARTS = ("queue", "reserve", "prefill", "transfer", "first_token")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))  # the smallest rank covering q%
    return ordered[rank - 1]


def link_summary(done: list[Outcome], link_s: dict[tuple[str, str], float], nbytes: int) -> dict:
    """The raw link rate (`link_s`: median seconds of one `nbytes` message per channel), weighted
    by the bytes each channel's transfers moved, and the transfers' utilization of it."""
    moved: dict[tuple[str, str], int] = {}
    for o in done:
        if o.pair is not None:
            moved[o.pair] = moved.get(o.pair, 0) + o.transfer_bytes
    measured = {pair: nbytes / seconds / 1e9 for pair, seconds in link_s.items() if seconds > 0}
    weights = {pair: moved.get(pair, 0) for pair in measured}
    total = sum(weights.values())
    link_gbps = sum(measured[p] * w for p, w in weights.items()) / total if total else 0.0
    return {
        "link_gbps": link_gbps,
        "link_message_bytes": nbytes,
        "links": [{"channel": f"{p}->{d}", "gbps": g} for (p, d), g in sorted(measured.items())],
    }


def leak_counts(workers: list[WorkerReading], *, unchecked: dict[str, str] | None = None) -> dict:
    """Pages and slots still held after the run drained, summed over the workers; None (unknown,
    not zero) when some worker's could not be read: `leaks_unchecked` maps each such worker to why
    (`unchecked`, and every worker listed dead or not answering: its memory went unread)."""
    unread = dict(unchecked or {})
    unread |= {w.name: w.state for w in workers if w.stats is None}
    stats = [w.stats for w in workers if w.stats is not None]
    return {
        "leaked_pages": None if unread else sum(s.pages_used for s in stats),
        "leaked_slots": None if unread else sum(s.slots_used for s in stats),
        "leaks_unchecked": unread,
    }


def failures_by_reason(outcomes: list[Outcome]) -> dict[str, int]:
    """Failed requests by the kind of failure that ended them (`FailureKind` values), most first."""
    failed = (o for o in outcomes if o.tokens is None and o.failure is not None and not o.cancelled)
    counts = Counter(o.failure.value for o in failed)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def retries_by_reason(outcomes: list[Outcome]) -> dict[str, int]:
    """Retried attempts by the kind of failure that ended them, most first: an envelope found
    corrupt on arrival and landed intact on a later attempt counts here, not in `corrupt_envelopes`."""
    counts = Counter(kind.value for o in outcomes for kind in o.retried_after)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _tpot_ms(o: Outcome) -> float | None:
    return o.decode_s * 1e3 / (len(o.tokens) - 1) if o.tokens is not None and len(o.tokens) > 1 else None


def by_path(done: list[Outcome], figure: Callable[[Outcome], float | None]) -> dict:
    """{remote, local} -> {p50, p99} of `figure` over the completed requests of each path; None for a
    path no completed request took (a latency of 0 would read as measured)."""
    out = {}
    for path in ("remote", "local"):
        values = [v for o in done if o.path == path and (v := figure(o)) is not None]
        out[path] = {q: percentile(values, n) if values else None for q, n in (("p50", 50), ("p99", 99))}
    return out


def bytes_by_rank(done: list[Outcome]) -> list[int]:
    """Bytes the transfers wrote on each rank of the decode workers (rank r of every decode worker
    counted together): one entry per rank, [] when nothing moved."""
    ranks = max((len(o.received_bytes) for o in done), default=0)
    return [sum(o.received_bytes[r] for o in done if len(o.received_bytes) > r) for r in range(ranks)]


def summarize(
    outcomes: list[Outcome],
    *,
    retried: int,
    worker_stats: list[WorkerReading],
    parity: Parity,
    wall_s: float,
    workers_lost: int = 0,
    workers_restarted: int = 0,
    model_impl: str = "reference",
    dtype: str = "float64",
    tp: tuple[int, int] = (1, 1),
    workers: tuple[int, int] = (1, 1),
    link: dict | None = None,
    multi_turn: dict | None = None,
    unchecked: dict[str, str] | None = None,
    lost_why: dict[str, str] | None = None,
    interrupted: bool = False,
    unfinished: int = 0,
) -> dict:
    """The run's figures; `multi_turn` (`TurnFeed.summary`) adds its conversations and turns.
    Counts that must survive a worker come from the outcomes (what each result reported), not from
    the workers; `unchecked` names workers whose leaks could not be read, and why (`leak_counts`).
    `lost_why`: how each lost worker was lost (died, stopped answering). `interrupted`: Ctrl-C ended
    the run, with `unfinished` requests not ended yet. `tp`: ranks per prefill and per decode worker;
    `workers`: prefill and decode workers (no prefill worker: colocated, nothing transferred)."""
    done = [o for o in outcomes if o.tokens is not None]
    read = [w.stats for w in worker_stats if w.stats is not None]
    ttft_ms = [o.ttft_s * 1e3 for o in done]
    tpot_ms = [o.decode_s * 1e3 / (len(o.tokens) - 1) for o in done if len(o.tokens) > 1]
    moved, seconds = sum(o.transfer_bytes for o in done), sum(o.transfer_s for o in done)
    moved_bytes = [float(o.transfer_bytes) for o in done]  # per request: less than the envelope after reuse
    runs = [float(r) for o in done for r in (o.source_runs, o.destination_runs)]
    link = link or {"link_gbps": 0.0, "link_message_bytes": 0, "links": []}
    transfer_gbps = moved / seconds / 1e9 if seconds else 0.0
    parts = {part: [getattr(o, f"{part}_s") * 1e3 for o in done] for part in TTFT_PARTS}
    local = [o for o in done if o.path == "local"]
    return {
        "deployment": "pd" if workers[0] else "colocated",
        "prefill_workers": workers[0],
        "decode_workers": workers[1],
        "model_impl": model_impl,
        "dtype": dtype,
        "prefill_tp": tp[0],
        "decode_tp": tp[1],
        "interrupted": interrupted,
        "requests": len(outcomes) + unfinished,
        "unfinished": unfinished,
        "completed": len(done),
        "failed": sum(o.tokens is None and not o.cancelled for o in outcomes),
        "cancelled": sum(o.cancelled for o in outcomes),  # by their callers (online serving)
        "failures_by_reason": failures_by_reason(outcomes),
        "retried": retried,
        "retries_by_reason": retries_by_reason(outcomes),  # corrupt arrivals retried show here
        "workers_lost": workers_lost,
        "workers_restarted": workers_restarted,
        "workers_lost_why": dict(lost_why or {}),
        "parity_checked": parity.checked,
        "parity_mismatches": parity.mismatches,
        "parity_near_ties": parity.near_ties,  # differed where the oracle's top-2 margin was < 1e-4
        # what each completed request's decode result said: a restarted worker forgets its own counts
        "verified_envelopes": sum(o.verified for o in done),
        "corrupt_envelopes": sum(o.corrupt for o in outcomes),
        "transfer_bytes": moved,
        "transfer_bytes_by_rank": bytes_by_rank(done),  # received, per decode rank
        # prefill's prefix cache: prompt tokens found cached, and those prefill computed
        "prefix_hit_tokens": sum(o.prompt_tokens - o.prefill_tokens_computed for o in done),
        "prefill_tokens_computed": sum(o.prefill_tokens_computed for o in done),
        # decode's prefix cache: prompt tokens whose pages decode held, so the transfer skipped them
        "decode_prefix_hit_tokens": sum(o.decode_prefix_hit_tokens for o in done),
        "cached_pages": sum(s.cached_pages for s in read),  # at the end, before dropping
        "checkpoints": sum(s.checkpoints for s in read),
        "evictions": sum(s.evicted_pages + s.evicted_checkpoints for s in read),
        # conditional disaggregation: requests prefilled on decode from a kept state, the prompt
        # tokens they computed there, and the final states decode workers kept
        "local_prefills": len(local),
        "local_prefill_tokens": sum(o.prefill_tokens_computed for o in local),
        "local_prefill_fallbacks": sum(o.local_refused for o in outcomes),  # refused: disaggregated
        # of which decode kept no state the prompt extends though the driver's view of its cache said so,
        # having reported it gone before the driver chose (0 unless the view is broken), or after
        "stale_view_refusals": sum(o.stale_view_refusals for o in outcomes),
        "refusals_news_in_flight": sum(o.refusals_news_in_flight for o in outcomes),
        "decode_state_checkpoints": sum(getattr(s, "decode_state_checkpoints", 0) for s in read),
        "transfer_gbps": transfer_gbps,
        **link,
        "link_utilization": transfer_gbps / link["link_gbps"] if link["link_gbps"] else 0.0,
        "transfer_bytes_p50": percentile(moved_bytes, 50),
        "transfer_bytes_max": max(moved_bytes, default=0.0),
        "runs_per_envelope_p50": percentile(runs, 50),
        "runs_per_envelope_max": max(runs, default=0.0),
        "ttft_ms_p50": percentile(ttft_ms, 50),
        "ttft_ms_p99": percentile(ttft_ms, 99),
        "ttft_breakdown_ms": {
            part: {"p50": percentile(v, 50), "p99": percentile(v, 99)} for part, v in parts.items()
        },
        "tpot_ms_p50": percentile(tpot_ms, 50),
        "tpot_ms_p99": percentile(tpot_ms, 99),
        "ttft_ms_by_path": by_path(done, lambda o: o.ttft_s * 1e3),
        "tpot_ms_by_path": by_path(done, _tpot_ms),
        "tokens_generated": sum(len(o.tokens) for o in done),
        # why each completed request ended: an EOS or stop id, or max_tokens (TPOT counts the tokens made)
        "finish_reasons": {
            reason: sum(o.finish is not None and o.finish.reason == reason for o in done)
            for reason in ("stop", "length")
        },
        "wall_s": wall_s,
        # `worker_stats` is read after the run drained and each prefix cache dropped (run.py): anything
        # still held then belongs to no request and to no cache.
        **leak_counts(worker_stats, unchecked=unchecked),
        "workers": [w.to_json() for w in worker_stats],
        "errors": [*parity.notes, *sorted({o.error for o in outcomes if o.tokens is None and o.error})][:10],
        **({"multi_turn": multi_turn} if multi_turn is not None else {}),
    }
