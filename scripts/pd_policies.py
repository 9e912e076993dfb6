"""`bench_pd.py --workload NAME`: one seeded workload served three ways, side by side in one invocation.

    no_cache     --no-prefix-cache                        every turn prefilled whole and moved whole
    cache        --prefix-cache --no-conditional-disagg   prefix caches on both sides (the default)
    conditional  --prefix-cache --conditional-disagg      a later turn prefilled on decode from its state

Each way is one `distpool run` (1P1D, the synthetic cache, every envelope byte-verified) with the same
model, budget, workload and seed; its `--json` summary gives, per way: bytes moved, prompt tokens
computed at prefill and at decode, TTFT and per-token latency p50 / p99 (also by path), local
prefills, envelopes verified / corrupt, leaks. With `--repeats N` the three ways run in turn N times
(round robin, so a machine's other load falls on all three alike); each figure is the median over
the repeats, and `spread` gives the lowest and highest TTFT p50 and per-token p99 seen (the noise).
JSON: `policies` -> {no_cache, cache, conditional} (and `conditional_always` with `--with-always-local`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

POLICIES = {
    "no_cache": ["--no-prefix-cache", "--no-conditional-disagg"],
    "cache": ["--prefix-cache", "--no-conditional-disagg"],
    "conditional": ["--prefix-cache", "--conditional-disagg"],
}
# `--with-always-local`: a fourth way, the policy allowing every local prefill it can (no cost model)
ALWAYS_LOCAL = {
    "conditional_always": ["--prefix-cache", "--conditional-disagg", "--local-prefill-max-tokens", "1000000"]
}
ROOT = Path(__file__).resolve().parents[1]


def run_flags(args, conditional: bool = True) -> list[str]:
    """The `distpool run` flags every way shares (the local prefill's only where it is on: `run`
    refuses them beside --no-conditional-disagg)."""
    flags = ["--model", args.model, "--model-impl", "synthetic", "--workload", args.workload]
    flags += ["--requests", str(args.requests), "--max-new-tokens", str(args.max_new_tokens)]
    flags += ["--context-len", str(args.context_len), "--page-size", str(args.page_size)]
    flags += ["--seed", str(args.seed), "--parity-sample", "0"]
    if args.memory_gib is not None:
        flags += ["--memory-gib", str(args.memory_gib)]
    if args.turns is not None:
        flags += ["--turns", str(args.turns)]
    if conditional and args.local_prefill_chunk is not None:
        flags += ["--local-prefill-chunk", str(args.local_prefill_chunk)]
    if conditional and args.local_prefill_max_tokens is not None:
        flags += ["--local-prefill-max-tokens", str(args.local_prefill_max_tokens)]
    return flags


def figures(report: dict) -> dict:
    """One way's figures from its `distpool run --json` summary."""
    local = report["local_prefill_tokens"]
    return {
        "completed": report["completed"],
        "failed": report["failed"],
        "transfer_bytes": report["transfer_bytes"],
        "prefill_tokens_computed_prefill": report["prefill_tokens_computed"] - local,
        "prefill_tokens_computed_decode": local,
        "prefix_hit_tokens": report["prefix_hit_tokens"],
        "decode_prefix_hit_tokens": report["decode_prefix_hit_tokens"],
        "local_prefills": report["local_prefills"],
        "decode_state_checkpoints": report["decode_state_checkpoints"],
        "ttft_ms": {"p50": report["ttft_ms_p50"], "p99": report["ttft_ms_p99"]},
        "tpot_ms": {"p50": report["tpot_ms_p50"], "p99": report["tpot_ms_p99"]},
        "ttft_ms_by_path": report["ttft_ms_by_path"],
        "tpot_ms_by_path": report["tpot_ms_by_path"],
        "verified_envelopes": report["verified_envelopes"],
        "corrupt_envelopes": report["corrupt_envelopes"],
        "leaked_pages": report["leaked_pages"],
        "leaked_slots": report["leaked_slots"],
        "wall_s": report["wall_s"],
    }


def run_once(args, way: str, tmp: Path, repeat: int) -> dict:
    """One `distpool run` of `way`: its figures. RuntimeError when it did not run at all."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    path = tmp / f"{way}-{repeat}.json"
    flags = {**POLICIES, **ALWAYS_LOCAL}[way]
    shared = run_flags(args, conditional="--no-conditional-disagg" not in flags)
    command = [sys.executable, "-m", "distpool", "run", *shared, *flags, "--json", str(path)]
    print(f"bench_pd: {way} ({repeat + 1}/{args.repeats}): {' '.join(command[3:])}", flush=True)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if not path.exists():
        raise RuntimeError(f"{way}: distpool run exited {done.returncode}: {done.stderr[-2000:]}")
    f = figures(json.loads(path.read_text())) | {"exit_status": done.returncode}
    computed = f"{f['prefill_tokens_computed_prefill']} + {f['prefill_tokens_computed_decode']}"
    print(
        f"  moved {f['transfer_bytes'] / 2**20:,.0f} MiB, computed {computed} (prefill + decode), "
        f"TTFT p50 {f['ttft_ms']['p50']:.0f} ms, per-token p99 {f['tpot_ms']['p99']:.1f} ms, "
        f"exit {done.returncode}",
        flush=True,
    )
    return f


def median(runs: list):
    """The median of each numeric figure over `runs` (nested alike); the worst exit status."""
    first = runs[0]
    if isinstance(first, dict):
        out = {key: median([run[key] for run in runs]) for key in first}
        if "exit_status" in first:
            out["exit_status"] = max(run["exit_status"] for run in runs)
        return out
    if first is None:
        return None
    return statistics.median(runs)


def serve_policies(args) -> dict:
    """Run each way `args.repeats` times, round robin; {way: median figures, spread}."""
    ways = [*POLICIES, *(ALWAYS_LOCAL if args.with_always_local else ())]
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for way in ways:
                runs[way].append(run_once(args, way, Path(tmp), repeat))
    out = {}
    for way, done in runs.items():
        out[way] = median(done) | {
            "spread": {
                "ttft_ms_p50": [
                    min(r["ttft_ms"]["p50"] for r in done),
                    max(r["ttft_ms"]["p50"] for r in done),
                ],
                "tpot_ms_p99": [
                    min(r["tpot_ms"]["p99"] for r in done),
                    max(r["tpot_ms"]["p99"] for r in done),
                ],
            },
            "repeats": len(done),
        }
    return out


def table(policies: dict) -> str:
    base = policies["no_cache"]["transfer_bytes"] or 1
    head = ("policy", "moved MiB", "saved", "prefill tok", "decode tok", "local", "TTFT p50/p99 ms")
    head += ("per-token p50/p99 ms", "verified/corrupt")
    rows = [head]
    for way, f in policies.items():
        rows.append(
            (
                way,
                f"{f['transfer_bytes'] / 2**20:,.0f}",
                f"{1 - f['transfer_bytes'] / base:.1%}",
                f"{f['prefill_tokens_computed_prefill']:.0f}",
                f"{f['prefill_tokens_computed_decode']:.0f}",
                f"{f['local_prefills']:.0f}",
                f"{f['ttft_ms']['p50']:.0f} / {f['ttft_ms']['p99']:.0f}",
                f"{f['tpot_ms']['p50']:.1f} / {f['tpot_ms']['p99']:.1f}",
                f"{f['verified_envelopes']:.0f} / {f['corrupt_envelopes']:.0f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
