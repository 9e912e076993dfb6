"""Pool benchmark: (a) reserve / release throughput, (b) how many requests a pool holds at once,
(c) allocator speed at serving scale, (d) a churn trace, (e) compaction bytes per second.

(a) Batched and one-at-a-time reserve + release on a unified hybrid-Mamba pool that is half full,
    plus a decode step (extend every running request by one token).
(b) At one memory budget, requests are admitted first come, first served, each reserving its final
    length (prompt + output), until the first one that does not fit. The unified arena is compared
    with static splits at several ratios (`mamba_state_ratio` for hybrid Mamba,
    `swa_full_tokens_ratio` for hybrid SWA), the configurator's default among them.

(c) On the reference model's pool (256 MiB: 65,536 page positions): batched reserve + release of 64
    requests on a pool churned to 80-95% occupancy and on a fresh one (one reserve + release cycle
    of a page counts as one page), and the median time of one `extend_batch` over 256 running
    requests when none crosses a page boundary and when every one does. Extent placement (the
    default) and first fit (the baseline) side by side.
(d) Two specs with real-size state slots (~50 MB and ~400 MB): seeded Poisson arrivals with
    long-tailed prompt and output lengths at 80-95% occupancy; each request reserves its prompt,
    grows by its output in four steps and leaves. Reports byte runs per envelope (extent vs first
    fit), compactions, and `refused_with_room`: reserves refused while the arena's free bytes
    (compaction reclaims every hole; the trace pins nothing) covered the request. Must be 0.
(e) A real-byte CPU arena (COMPACTION_ARENA_GIB) half emptied at random, then compacted: GB/s of
    compaction next to one large memcpy of the same bytes on the same machine.

Arenas live on the `meta` device except in (e): ids and accounting are real, bytes are not
allocated, so realistic budgets fit on any machine.

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
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from churn import (  # noqa: E402
    TRACE_CONTEXT_LEN,
    run_churn,
    trace_pool,
    trace_spec,
)

from distpool.memory.alloc import RUN_BYTES  # noqa: E402
from distpool.memory.arena_pool import ArenaPool, build_pool  # noqa: E402
from distpool.memory.pool import DoesNotFit  # noqa: E402
from distpool.memory.sizing import GIB, PoolArgs, size_pools  # noqa: E402
from distpool.model.hf_config import spec_from_hf  # noqa: E402
from distpool.model.spec import HYBRID_MAMBA, ModelSpec  # noqa: E402
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG  # noqa: E402
from transfer.ends.staging import gather, scatter  # noqa: E402

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
# (c) allocator speed on the reference model's pool
SPEED_POOL_MIB = 256  # 65,536 pages of 4 KiB
SPEED_CONTEXT_LEN = 8192
CHURN_OCCUPANCY = (0.80, 0.95)  # the churned pool stays inside this band, with the batch in it
DECODE_REQUESTS = 256
SPEED_SAMPLES = {"full": 400, "quick": 150}  # timed calls per figure; the median is reported
# (d) churn trace: ~50 MB and ~400 MB state slots (Qwen3-Next's layout with more or fewer SSM heads)
TRACE_SPECS = {"slot_50mb": (21, 40), "slot_400mb": (170, 128)}  # name -> (ssm heads, budget GiB)
TRACE_REQUESTS = {"full": 30_000, "quick": 10_000}  # the trace itself: scripts/churn.py
# (e) compaction on real bytes: as large as a quick run allows on a 2-core, 23 GiB machine
COMPACTION_ARENA_GIB = {"full": 4, "quick": 2}
# and what one byte run costs a transfer: pieces as one run and as RUN_COST_RUNS runs (few enough
# that the copy loops over them, as it does for an envelope in a handful of runs)
RUN_COST_RUNS = 8
RUN_COST_PIECE_BYTES = 4096
RUN_COST_REPEATS = 2000


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
    steps, timed = 0, 0.0
    while timed < seconds:  # at most 256 steps per reservation, so the pool never fills up
        pool.reserve_batch(list(zip(ids, lengths, strict=True)))
        for _ in range(256):
            start = time.perf_counter()
            pool.extend_batch([(rid, 1) for rid in ids])
            timed += time.perf_counter() - start
        steps += 256
        pool.release_batch(ids)
    out["decode_extend_requests_per_s"] = steps / timed * BATCH
    pool.check_invariants()
    return out


# ---- (c) allocator speed ---------------------------------------------------------------------------
def speed_pool(placement: str) -> ArenaPool:
    spec = spec_from_hf(REFERENCE_HYBRID_CONFIG)
    args = PoolArgs(
        enable_unified_memory=True,
        page_size=PAGE_SIZE,
        context_len=SPEED_CONTEXT_LEN,
        max_running_requests=MAX_RUNNING,
    )
    return build_pool(size_pools(spec, args, SPEED_POOL_MIB << 20), "meta", placement=placement)


def live_bytes(pool: ArenaPool) -> int:
    usage = pool.usage()
    return (
        usage["pages"].held * pool.arena.high.stride_bytes + usage["slots"].held * pool.arena.low.stride_bytes
    )


def occupancy(pool: ArenaPool) -> float:
    return live_bytes(pool) / pool.sizes.arena_bytes


def churn(pool: ArenaPool, rng: np.random.Generator, target: float, rounds: int = 6) -> None:
    """Fill to 95%, then release a random third and refill, `rounds` times (holes everywhere);
    end by releasing at random from a full pool down to `target` occupancy."""
    live: list[str] = []
    serial = 0
    for round_ in range(rounds + 1):
        while occupancy(pool) < CHURN_OCCUPANCY[1]:
            rid, serial = f"bg{serial}", serial + 1
            try:
                pool.reserve(rid, int(rng.integers(16, 4096)), compact=True)
            except DoesNotFit:
                break
            live.append(rid)
        if round_ == rounds:
            break
        victims = set(rng.choice(len(live), size=len(live) // 3, replace=False).tolist())
        pool.release_batch([r for i, r in enumerate(live) if i in victims])
        live = [r for i, r in enumerate(live) if i not in victims]
    rng.shuffle(live)
    while occupancy(pool) > target:
        pool.release(live.pop())


def reserve_release_rates(pool: ArenaPool, rng: np.random.Generator, samples: int) -> dict[str, float]:
    """Median pages/s and requests/s of one batched reserve + release cycle of BATCH requests."""
    lengths = rng.integers(64, 2048, BATCH).tolist()
    pages = sum(pool.pages_for(n) for n in lengths)
    batch = [(f"b{j}", n) for j, n in enumerate(lengths)]
    ids = [rid for rid, _ in batch]
    before = occupancy(pool)
    pool.reserve_batch(batch, compact=True)  # a compaction, if any, happens here, untimed
    after = occupancy(pool)
    pool.release_batch(ids)
    seconds = []
    for _ in range(samples):
        start = time.perf_counter()
        pool.reserve_batch(batch)
        pool.release_batch(ids)
        seconds.append(time.perf_counter() - start)
    pool.check_invariants()
    median = float(np.median(seconds))
    return {
        "pages_per_s": pages / median,
        "requests_per_s": BATCH / median,
        "pages_per_batch": pages,
        "occupancy_before": before,
        "occupancy_with_batch": after,
    }


def extend_batch_us(placement: str, rng: np.random.Generator, samples: int) -> dict[str, float]:
    """Median microseconds of one pool `extend_batch` by one token over DECODE_REQUESTS requests:
    with no request crossing a page boundary, and with every one crossing.

    Steady state: the first `warmup` steps after each pool's reserve run untimed (they look the
    batch's rows up and keep them, as a decode loop's first steps after a batch changes do); every
    later call is timed, and nothing else runs between the calls but the untimed rest-of-page
    extend that brings the next step to a page boundary."""
    warmup = 2
    no_new_page, new_page = [], []
    ids = [f"d{j}" for j in range(DECODE_REQUESTS)]
    step = [(rid, 1) for rid in ids]
    rest_of_page = [(rid, PAGE_SIZE - 1) for rid in ids]
    while len(new_page) < samples:
        pool = speed_pool(placement)
        # n = k * PAGE_SIZE + 1 tokens: the next PAGE_SIZE - 1 single-token steps stay in the page.
        pool.reserve_batch([(rid, PAGE_SIZE * int(rng.integers(4, 64)) + 1) for rid in ids])
        for i in range(PAGE_SIZE - 1):
            start = time.perf_counter()
            pool.extend_batch(step)
            if i >= warmup:
                no_new_page.append(time.perf_counter() - start)
        for _ in range(20):  # every request holds a full last page: each step takes 256 pages
            start = time.perf_counter()
            pool.extend_batch(step)
            new_page.append(time.perf_counter() - start)
            pool.extend_batch(rest_of_page)
        pool.check_invariants()
    return {"no_new_page": float(np.median(no_new_page)) * 1e6, "new_page": float(np.median(new_page)) * 1e6}


def allocator_speed(mode: str, rng: np.random.Generator) -> dict:
    samples = SPEED_SAMPLES[mode]
    out: dict = {}
    for placement in ("extent", "first_fit"):
        churned = speed_pool(placement)
        churn(churned, np.random.default_rng(SEED), target=CHURN_OCCUPANCY[0] + 0.03)
        out[placement] = {
            "churned": reserve_release_rates(churned, np.random.default_rng(SEED + 1), samples),
            "fresh": reserve_release_rates(speed_pool(placement), np.random.default_rng(SEED + 1), samples),
            "extend_batch_us": extend_batch_us(placement, np.random.default_rng(SEED + 2), samples),
        }
        print(f"  {placement}: {json.dumps(out[placement])}", file=sys.stderr, flush=True)
    return out


# ---- (d) churn trace -------------------------------------------------------------------------------
def run_trace(spec: ModelSpec, budget: int, placement: str, num_requests: int, seed: int) -> dict:
    """One churn trace (see the module docstring); every figure from the benchmark's own counts."""
    pool = trace_pool(spec, budget, placement)
    stats = run_churn(pool, num_requests, seed)
    compactions, moved, _ = pool.compactions()
    runs = np.array(stats["runs"])
    occ = np.array(stats["occupancy"])
    return {
        "runs_p50": float(np.percentile(runs, 50)),
        "runs_p99": float(np.percentile(runs, 99)),
        "refused_with_room": stats["refused_with_room"],
        "preempted": stats["preempted"],
        "compactions": compactions,
        "compaction_bytes_per_request": moved / num_requests,
        "envelope_bytes_mean": stats["envelope_bytes_mean"],
        "occupancy_mean": float(occ.mean()),
        "occupancy_p10_p90": [float(np.percentile(occ, 10)), float(np.percentile(occ, 90))],
        "requests": num_requests,
    }


def churn_traces(mode: str) -> dict:
    out = {}
    for name, (heads, budget_gib) in TRACE_SPECS.items():
        spec = trace_spec(heads)
        rows = {
            p: run_trace(spec, budget_gib * GIB, p, TRACE_REQUESTS[mode], SEED)
            for p in ("extent", "first_fit")
        }
        out[name] = {
            "slot_mb": spec.slot_bytes / 1e6,
            "budget_gib": budget_gib,
            "runs_per_envelope": {
                "p50": rows["extent"]["runs_p50"],
                "p99": rows["extent"]["runs_p99"],
                "first_fit_p50": rows["first_fit"]["runs_p50"],
                "first_fit_p99": rows["first_fit"]["runs_p99"],
            },
            "refused_with_room": rows["extent"]["refused_with_room"] + rows["first_fit"]["refused_with_room"],
            "compactions": rows["extent"]["compactions"],
            "extent": rows["extent"],
            "first_fit": rows["first_fit"],
        }
        print(f"  {name}: {json.dumps(out[name])}", file=sys.stderr, flush=True)
    return out


# ---- (e) compaction on real bytes ------------------------------------------------------------------
def compaction_rate(mode: str) -> dict[str, float]:
    """GB/s of `compact()` on a real CPU arena half emptied at random, and of one memcpy."""
    budget = COMPACTION_ARENA_GIB[mode] * GIB
    spec = trace_spec(TRACE_SPECS["slot_50mb"][0])
    args = PoolArgs(enable_unified_memory=True, page_size=PAGE_SIZE, context_len=TRACE_CONTEXT_LEN // 8)
    pool = build_pool(size_pools(spec, args, budget), "cpu")
    rng = np.random.default_rng(SEED)
    held = fill(pool, rng.integers(256, 8192, 10_000).tolist())
    victims = rng.choice(held, size=held // 2, replace=False).tolist()
    pool.release_batch([f"r{i}" for i in victims])
    start = time.perf_counter()
    moved = pool.compact()
    compact_s = time.perf_counter() - start
    pool.check_invariants()
    half = budget // 2  # one copy of the same byte count between two halves of the arena
    nbytes = min(moved, half)
    start = time.perf_counter()
    pool.buffer[half : half + nbytes].copy_(pool.buffer[:nbytes])
    memcpy_s = time.perf_counter() - start
    run_us = transfer_run_us(pool)
    del pool
    compaction_gbps = moved / compact_s / 1e9
    return {
        "arena_gib": COMPACTION_ARENA_GIB[mode],
        "bytes_moved": moved,
        "compaction_gbps": compaction_gbps,
        "memcpy_gbps": nbytes / memcpy_s / 1e9,
        "transfer_run_us": run_us,
        # The cost model's price of one byte run (move_cost.py): what copying costs in its time.
        "run_bytes": run_us * 1e-6 * compaction_gbps * 1e9,
        "run_bytes_in_model": RUN_BYTES,
    }


def transfer_run_us(pool: ArenaPool) -> float:
    """Microseconds one more byte run costs a transfer: a gather and a scatter (transfer/ends/staging.py,
    each side's copy) of RUN_COST_RUNS pieces against one piece of the same bytes, per piece added,
    the median of interleaved pairs. The pieces are small so that the copy's own time, the same in
    both, does not drown the per-piece cost in its noise."""
    base = pool.arena.high.base_bytes
    one = (np.array([base]), np.array([RUN_COST_RUNS * RUN_COST_PIECE_BYTES]))
    starts = base + np.arange(RUN_COST_RUNS) * 2 * RUN_COST_PIECE_BYTES  # a piece apart
    split = (starts, np.full(RUN_COST_RUNS, RUN_COST_PIECE_BYTES))
    packed = torch.empty(RUN_COST_RUNS * RUN_COST_PIECE_BYTES, dtype=torch.uint8)

    def seconds(offsets: np.ndarray, nbytes: np.ndarray) -> float:
        start = time.perf_counter()
        gather(pool.buffer, offsets, nbytes, packed)
        scatter(packed, offsets, nbytes, pool.buffer)
        return time.perf_counter() - start

    seconds(*one), seconds(*split)  # warm-up
    times = np.array([(seconds(*one), seconds(*split)) for _ in range(RUN_COST_REPEATS)])  # interleaved
    added = float(np.median(times[:, 1] - times[:, 0]))
    return max(added, 0.0) / (RUN_COST_RUNS - 1) * 1e6


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
    parser.add_argument("--quick", action="store_true", help="a smaller budget and shorter timings (~3 min)")
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
    print(f"(c) allocator speed: reference model, {SPEED_POOL_MIB} MiB, batch {BATCH}", file=sys.stderr)
    speed = allocator_speed(mode, rng)
    print(f"(d) churn traces: {TRACE_REQUESTS[mode]} requests each", file=sys.stderr)
    traces = churn_traces(mode)
    print(f"(e) compaction on a {COMPACTION_ARENA_GIB[mode]} GiB CPU arena", file=sys.stderr)
    compaction = compaction_rate(mode)

    print(f"\nreserve + release, batch of {BATCH} ({tput['background_requests']:.0f} requests in the pool):")
    print(f"  batched: {tput['batched_ops_per_s']:,.0f} ops/s ({tput['batched_pages_per_s']:,.0f} pages/s)")
    print(
        f"  one at a time: {tput['single_ops_per_s']:,.0f} ops/s ({tput['single_pages_per_s']:,.0f} pages/s)"
    )
    print(f"  decode step (extend_batch by 1): {tput['decode_extend_requests_per_s']:,.0f} requests/s")
    print(f"\nallocator speed ({SPEED_POOL_MIB} MiB reference pool)   extent      first_fit")
    for label, key, scope in (
        ("reserve+release pages/s (churned)", "pages_per_s", "churned"),
        ("reserve+release requests/s (churned)", "requests_per_s", "churned"),
        ("reserve+release pages/s (fresh)", "pages_per_s", "fresh"),
        ("reserve+release requests/s (fresh)", "requests_per_s", "fresh"),
    ):
        print(f"  {label:<38}{speed['extent'][scope][key]:>12,.0f}{speed['first_fit'][scope][key]:>14,.0f}")
    for key in ("no_new_page", "new_page"):
        extent, first = speed["extent"]["extend_batch_us"][key], speed["first_fit"]["extend_batch_us"][key]
        print(f"  {'extend_batch us (' + key + ')':<38}{extent:>12.1f}{first:>14.1f}")
    print(
        "\nchurn trace          runs/envelope p50 p99 (first fit)  refused_with_room  compactions"
        "  moved MB/request (first fit)  envelope MB  occupancy (first fit)"
    )
    for name, t in traces.items():
        r = t["runs_per_envelope"]
        extent, first = t["extent"], t["first_fit"]
        moved, first_moved = (row["compaction_bytes_per_request"] / 1e6 for row in (extent, first))
        print(
            f"  {name:<20}{r['p50']:>6.0f}{r['p99']:>6.0f}"
            f"  ({r['first_fit_p50']:.0f}, {r['first_fit_p99']:.0f})"
            f"{t['refused_with_room']:>22}{t['compactions']:>13}"
            f"{moved:>18.1f} ({first_moved:.1f})"
            f"{extent['envelope_bytes_mean'] / 1e6:>13.1f}"
            f"{extent['occupancy_mean']:>11.1%} ({first['occupancy_mean']:.1%})"
        )
    print(
        f"\ncompaction ({compaction['arena_gib']} GiB CPU arena): {compaction['compaction_gbps']:.2f} GB/s; "
        f"memcpy {compaction['memcpy_gbps']:.2f} GB/s; a transfer's byte run "
        f"{compaction['transfer_run_us']:.1f} us = {compaction['run_bytes'] / 1e3:,.0f} KB of compaction "
        f"(the allocator's cost model: {RUN_BYTES / 1e3:,.0f} KB)"
    )
    print_table(rows)
    plot(rows, args.plot)
    print(f"plot: {args.plot}")
    if args.json:
        result = {
            "reserve_release_ops_per_s": tput["batched_ops_per_s"],
            "reserve_release_pages_per_s": speed["extent"]["churned"]["pages_per_s"],
            "reserve_release_requests_per_s": speed["extent"]["churned"]["requests_per_s"],
            "reserve_release_fresh_pages_per_s": speed["extent"]["fresh"]["pages_per_s"],
            "reserve_release_fresh_requests_per_s": speed["extent"]["fresh"]["requests_per_s"],
            "extend_batch_us": speed["extent"]["extend_batch_us"],
            "churn_trace": traces,
            "runs_per_envelope": {name: t["runs_per_envelope"] for name, t in traces.items()},
            "refused_with_room": sum(t["refused_with_room"] for t in traces.values()),
            "compactions": sum(t["compactions"] for t in traces.values()),
            "compaction_gbps": compaction["compaction_gbps"],
            "memcpy_gbps": compaction["memcpy_gbps"],
            "compaction": compaction,
            "allocator_speed": speed,
            "throughput": tput,
            "capacity": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
