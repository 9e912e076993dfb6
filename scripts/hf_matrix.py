"""The transformers runner across the wider matrix: each supported architecture, 2P2D, unified and
static pools, transfers aborted at random (--fault-rate 0.2), prefix caching on both sides.

Every run is `distpool run --model-impl transformers --dtype float64` (or `--dtype float32`) on a
tiny seeded checkpoint (`distpool.model_impl.hf.tiny`) in one local Ray cluster, every completed
request checked against transformers' `generate` (--parity-sample covers them all).

    .venv/bin/python scripts/hf_matrix.py --quick --json out/hf_matrix.json
    .venv/bin/python scripts/hf_matrix.py --dtype float32 --arch bamba --arch qwen3_next --arch jamba

Targets: every run exits 0: every request completes (retried on another pair after an abort),
0 parity mismatches, 0 leaked pages or slots. In float32 a differing token where `generate` was
unsure by less than 1e-4 between its top two logits is a near tie (`parity_near_ties`), not a
mismatch. --quick runs the multi-turn workload only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from distpool.cli import main as distpool  # noqa: E402
from distpool.model_impl.hf.tiny import TINY_CONFIGS, save_checkpoint  # noqa: E402

# ---- parameters ----------------------------------------------------------------------------------
SEED = 11
FAULT_RATE = 0.2
POOLS = {"unified": "--enable-unified-memory", "static": "--disable-unified-memory"}
DTYPES = ("float64", "float32")
COMMON = ["--prefill", "2", "--decode", "2", "--page-size", "8"]
COMMON += ["--memory-gib", "0.0625", "--max-new-tokens", "8", "--fault-rate", str(FAULT_RATE)]
WORKLOADS = {
    # conversations of 3 turns: later turns continue cached prefixes and decode's held pages
    "multi-turn": ["--workload", "multi-turn", "--requests", "9", "--turns", "3", "--context-len", "2048"],
    "mixed": ["--workload", "mixed", "--requests", "16", "--context-len", "256"],
}
KEYS = (
    "requests completed failed retried parity_checked parity_mismatches parity_near_ties "
    "prefix_hit_tokens decode_prefix_hit_tokens leaked_pages leaked_slots"
).split()


def run_one(folder: Path, pools: str, workload: str, out: Path, dtype: str) -> dict:
    report = out / f"{folder.name}-{pools}-{workload}.json"
    args = ["run", "--model", str(folder), "--model-impl", "transformers", "--dtype", dtype, *COMMON]
    args.append(POOLS[pools])
    args += [*WORKLOADS[workload], "--seed", str(SEED), "--parity-sample", "1000", "--json", str(report)]
    started = time.monotonic()
    status = distpool(args)
    row = {"arch": folder.name, "dtype": dtype, "pools": pools, "workload": workload, "status": status}
    if report.is_file():
        figures = json.loads(report.read_text())
        row |= {key: figures[key] for key in KEYS} | {"errors": figures["errors"][:3]}
    return row | {"wall_s": round(time.monotonic() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the multi-turn workload only")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--arch", action="append", choices=list(TINY_CONFIGS), help="(default: all six)")
    parser.add_argument("--dtype", choices=DTYPES, default=DTYPES[0], help="the runner's compute dtype")
    args = parser.parse_args()
    workloads = ["multi-turn"] if args.quick else list(WORKLOADS)
    rows = []
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            for arch in args.arch or list(TINY_CONFIGS):
                folder = save_checkpoint(arch, root / arch)
                for pools in POOLS:
                    for workload in workloads:
                        rows.append(run_one(folder, pools, workload, root, args.dtype))
                        print(f"hf_matrix: {rows[-1]}", flush=True)
    finally:
        ray.shutdown()
    header = f"{'arch':<18}{'pools':<9}{'workload':<12}{'exit':>5}{'done':>9}{'retried':>9}{'parity':>12}"
    header += f"{'prefix hit':>12}{'decode hit':>12}{'leaks':>7}{'s':>7}"
    print("\n" + header)
    for r in rows:
        parity = (
            f"{r.get('parity_checked', 0)}/{r.get('parity_mismatches', 0)}/{r.get('parity_near_ties', 0)}"
        )
        print(
            f"{r['arch']:<18}{r['pools']:<9}{r['workload']:<12}{r['status']:>5}"
            f"{r.get('completed', 0):>4}/{r.get('requests', 0):<4}{r.get('retried', 0):>9}{parity:>12}"
            f"{r.get('prefix_hit_tokens', 0):>12}{r.get('decode_prefix_hit_tokens', 0):>12}"
            f"{r.get('leaked_pages', 0) + r.get('leaked_slots', 0):>7}{r['wall_s']:>7}"
        )
    print("(parity: checked / mismatches / near ties)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        summary = {"fault_rate": FAULT_RATE, "dtype": args.dtype, "rows": rows}
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if all(r["status"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
