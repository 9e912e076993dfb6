"""Pool benchmark: (a) reserve / release throughput, (b) how many requests a pool holds at once.

(a) Batched and one-at-a-time reserve + release on a unified hybrid-Mamba pool that is half full,
    plus a decode step (extend every running request by one token).
(b) At one memory budget, requests are admitted first come, first served, each reserving its final
    length (prompt + output), until the first one that does not fit. The unified arena is compared
    with static splits at several ratios (`mamba_state_ratio` for hybrid Mamba,
    `swa_full_tokens_ratio` for hybrid SWA), the configurator's default among them.

Arenas live on the `meta` device: ids and accounting are real, bytes are not allocated, so realistic
budgets fit on any machine.

    python scripts/bench_pool.py [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from distpool.memory.arena_pool import build_pool  # noqa: E402
from distpool.memory.pool import DoesNotFit  # noqa: E402
from distpool.memory.sizing import GIB, PoolArgs, size_pools  # noqa: E402
from distpool.model.hf_config import spec_from_hf  # noqa: E402
from distpool.model.spec import HYBRID_MAMBA, ModelSpec  # noqa: E402

# ---- parameters ----------------------------------------------------------------------------------
SEED = 0
MODELS = {  # name -> Hugging Face config.json
    "qwen3_next": REPO / "tests/fixtures/qwen3_next.json",
    "gpt_oss": REPO / "tests/fixtures/gpt_oss.json",
}
PAGE_SIZE = 16
CONTEXT_LEN = 65536
BUDGET_GIB = {"full": 64, "quick": 16}
MAX_RUNNING = 100_000  # high enough that neither pool is capped by a request count
RATIOS = {  # static splits per model kind; the configurator's default is included
    HYBRID_MAMBA: (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9),
    "hybrid_swa": (0.05, 0.1, 0.25, 0.5, 0.8, 1.0),
}
DEFAULT_RATIO = {HYBRID_MAMBA: PoolArgs().mamba_state_ratio, "hybrid_swa": PoolArgs().swa_full_tokens_ratio}
NUM_REQUESTS = {"full": 20_000, "quick": 5_000}  # drawn per workload; a fill stops at the first misfit
THROUGHPUT_SECONDS = {"full": 2.0, "quick": 0.5}
BATCH = 64


def draw_workload(name: str, n: int, rng: np.random.Generator) -> list[int]:
    """Final lengths (prompt + output tokens) of `n` requests."""
    if name == "short":
        prompt, output = rng.integers(64, 1024, n), rng.integers(16, 256, n)
    elif name == "long_tailed":
        prompt = rng.lognormal(math.log(1024), 1.5, n).astype(int)
        output = rng.lognormal(math.log(200), 1.0, n).astype(int)
    elif name == "long":
        prompt, output = rng.integers(16_384, 49_152, n), rng.integers(256, 2048, n)
    else:
        raise ValueError(f"unknown workload {name!r}")
    return np.clip(prompt + output, 16, CONTEXT_LEN).tolist()


WORKLOADS = ("short", "long_tailed", "long")


def make_pool(spec: ModelSpec, budget: int, *, unified: bool, ratio: float | None = None):
    ratio_arg = {}
    if ratio is not None:
        key = "mamba_state_ratio" if spec.kind == HYBRID_MAMBA else "swa_full_tokens_ratio"
        ratio_arg = {key: ratio}
    args = PoolArgs(
        enable_unified_memory=unified,
        page_size=PAGE_SIZE,
        context_len=CONTEXT_LEN,
        max_running_requests=MAX_RUNNING,
        **ratio_arg,
    )
    return build_pool(size_pools(spec, args, budget), "meta")


def fill(pool, lengths: list[int]) -> int:
    """Admit first come, first served until a request does not fit; returns how many were held."""
    for i, n in enumerate(lengths):
        try:
            pool.reserve(f"r{i}", n, compact=True)
        except DoesNotFit:
            return i
    pool.check_invariants()
    return len(lengths)


def _median_rate(call, seconds: float, repeats: int = 5) -> float:
    """Calls per second: the median over `repeats` timed stretches of about `seconds / repeats`
    (the median shrugs off other processes that share the machine)."""
    rates = []
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / repeats:
            call()
            calls += 1
        rates.append(calls / elapsed)
    return float(np.median(rates))


def throughput(spec: ModelSpec, budget: int, seconds: float, rng: np.random.Generator) -> dict[str, float]:
    pool = make_pool(spec, budget, unified=True)
    background = fill(pool, draw_workload("short", 100_000, rng))
    pool.release_batch([f"r{i}" for i in range(0, background, 2)])  # half full, with holes
    pool.compact()
    lengths = draw_workload("short", BATCH, rng)
    pages_per_batch = sum(-(-n // PAGE_SIZE) for n in lengths)
    out: dict[str, float] = {"background_requests": background - (background + 1) // 2}
    serial = 0

    def one_round(mode: str) -> None:
        nonlocal serial
        ids = [f"t{serial + j}" for j in range(BATCH)]
        serial += BATCH
        if mode == "batched":
            pool.reserve_batch(list(zip(ids, lengths, strict=True)))
            pool.release_batch(ids)
        else:
            for rid, n in zip(ids, lengths, strict=True):
                pool.reserve(rid, n)
            for rid in ids:
                pool.release(rid)

    for mode in ("batched", "single"):
        rounds_per_s = _median_rate(lambda mode=mode: one_round(mode), seconds)
        out[f"{mode}_ops_per_s"] = rounds_per_s * 2 * BATCH
        out[f"{mode}_pages_per_s"] = rounds_per_s * 2 * pages_per_batch
    ids = [f"d{j}" for j in range(BATCH)]
    pool.reserve_batch(list(zip(ids, lengths, strict=True)))
    steps_per_s = _median_rate(lambda: pool.extend_batch([(rid, 1) for rid in ids]), seconds)
    out["decode_extend_requests_per_s"] = steps_per_s * BATCH
    pool.check_invariants()
    return out


def capacity(spec: ModelSpec, budget: int, num_requests: int, label: str) -> list[dict]:
    rows = []
    for workload in WORKLOADS:
        lengths = draw_workload(workload, num_requests, np.random.default_rng(SEED))
        unified = fill(make_pool(spec, budget, unified=True), lengths)
        static = []
        for ratio in RATIOS[spec.kind]:
            try:
                held = fill(make_pool(spec, budget, unified=False, ratio=ratio), lengths)
            except ValueError:  # the configurator refuses a split that cannot hold one long request
                held = 0
            static.append({"ratio": ratio, "requests": held, "default": ratio == DEFAULT_RATIO[spec.kind]})
        rows.append({"workload": f"{label}/{workload}", "unified_requests": unified, "static": static})
        best = max(static, key=lambda s: s["requests"])
        print(
            f"  {label}/{workload}: unified {unified}, best static {best['requests']} at {best['ratio']}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def print_table(rows: list[dict]) -> None:
    ratios = sorted({s["ratio"] for r in rows for s in r["static"]})
    print(f"\n{'workload':<24}{'unified':>9}" + "".join(f"{'r=' + str(q):>9}" for q in ratios))
    for r in rows:
        by_ratio = {s["ratio"]: s for s in r["static"]}
        cells = []
        for q in ratios:
            s = by_ratio.get(q)
            cells.append(f"{'' if s is None else str(s['requests']) + ('*' if s['default'] else ''):>9}")
        print(f"{r['workload']:<24}{r['unified_requests']:>9}" + "".join(cells))
    print("(* the configurator's default ratio; 0: the split cannot hold one context_len request)")


def plot(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(rows)), 4.5))
    width = 0.8 / (1 + max(len(r["static"]) for r in rows))
    for i, r in enumerate(rows):
        ax.bar(i, r["unified_requests"], width, color="tab:red", label="unified" if i == 0 else None)
        for j, s in enumerate(r["static"]):
            color = "tab:blue" if s["default"] else plt.cm.Greys(0.3 + 0.6 * j / len(r["static"]))
            ax.bar(i + (j + 1) * width, s["requests"], width, color=color)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [r["workload"] for r in rows], rotation=20)
    ax.set_ylabel("requests held at once")
    top = max(max(r["unified_requests"], *(s["requests"] for s in r["static"])) for r in rows)
    ax.set_yscale("log")
    ax.set_ylim(0.8, top * 2)
    ax.set_title("unified arena (red) vs static splits (grey, low to high ratio; blue: default)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller budget and shorter timings (< 1 min)")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, default=REPO / "out/bench_pool.png", help="PNG path")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    budget = BUDGET_GIB[mode] * GIB
    rng = np.random.default_rng(SEED)
    specs = {name: spec_from_hf(path) for name, path in MODELS.items()}

    print(f"(a) throughput: {next(iter(specs))}, {BUDGET_GIB[mode]} GiB, batch {BATCH}", file=sys.stderr)
    tput = throughput(next(iter(specs.values())), budget, THROUGHPUT_SECONDS[mode], rng)
    print(
        f"(b) capacity: {BUDGET_GIB[mode]} GiB, page_size {PAGE_SIZE}, context_len {CONTEXT_LEN}",
        file=sys.stderr,
    )
    rows = [row for name, spec in specs.items() for row in capacity(spec, budget, NUM_REQUESTS[mode], name)]

    print(f"\nreserve + release, batch of {BATCH} ({tput['background_requests']:.0f} requests in the pool):")
    print(f"  batched: {tput['batched_ops_per_s']:,.0f} ops/s ({tput['batched_pages_per_s']:,.0f} pages/s)")
    print(
        f"  one at a time: {tput['single_ops_per_s']:,.0f} ops/s ({tput['single_pages_per_s']:,.0f} pages/s)"
    )
    print(f"  decode step (extend_batch by 1): {tput['decode_extend_requests_per_s']:,.0f} requests/s")
    print_table(rows)
    plot(rows, args.plot)
    print(f"plot: {args.plot}")
    if args.json:
        result = {
            "reserve_release_ops_per_s": tput["batched_ops_per_s"],
            "throughput": tput,
            "capacity": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
