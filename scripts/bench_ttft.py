"""TTFT with the decode reservation made while prefill computes, against reserving first.

Runs `distpool run` (a fresh embedded Ray cluster each time) for each workload, alternating the two
orders (`--reserve-first` is the order before) so that the machine's load drifts over both alike,
and reports per workload and order the median over repeats of each run's TTFT p50 and of its
`reserve` and `prefill` parts, every run's figure beside it:

    python scripts/bench_ttft.py --repeats 5 --json out/bench_ttft.json

Workloads: `make run` (the default arguments: 32 mixed requests, 1P1D, reference model) and a single
request (`--requests 1`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOADS = {"make run": [], "one request": ["--requests", "1"]}
ORDERS = {"overlapped": [], "reserve first": ["--reserve-first"]}
REPEATS = 5
RUN_TIMEOUT_S = 600


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=REPEATS, help="runs per workload and order")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every run's figures")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    return args


def one_run(extra: list[str]) -> dict:
    """One `distpool run` with `extra` arguments; its report's TTFT figures (ms)."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        command = [sys.executable, "-m", "distpool", "run", *extra, "--json", str(path)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if done.returncode != 0 or not path.exists():
            raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
        report = json.loads(path.read_text())
    parts = report["ttft_breakdown_ms"]
    return {
        "completed": report["completed"],
        "retried": report["retried"],
        "ttft_ms_p50": report["ttft_ms_p50"],
        "reserve_ms_p50": parts["reserve"]["p50"],
        "prefill_ms_p50": parts["prefill"]["p50"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs: dict[str, dict[str, list[dict]]] = {w: {o: [] for o in ORDERS} for w in WORKLOADS}
    for repeat in range(args.repeats):
        for workload, workload_args in WORKLOADS.items():
            for order, order_args in ORDERS.items():
                figures = one_run(workload_args + order_args)
                runs[workload][order].append(figures)
                print(f"  {repeat + 1}/{args.repeats} {workload}, {order}: {figures}", flush=True)
    print(f"\n{'workload':<13} {'order':<14} {'TTFT p50':>9} {'reserve':>8} {'prefill':>8}  each run")
    for workload, orders in runs.items():
        for order, figures in orders.items():
            med = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
            each = " ".join(f"{f['ttft_ms_p50']:.1f}" for f in figures)
            print(
                f"{workload:<13} {order:<14} {med['ttft_ms_p50']:>7.1f}ms {med['reserve_ms_p50']:>6.1f}ms "
                f"{med['prefill_ms_p50']:>6.1f}ms  {each}"
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
