"""The transformers runner through a pool against transformers' own `generate`, side by side.

For each of the six architectures (a tiny seeded checkpoint, float32, one process, no Ray): the pooled
runner (reserve, prefill and decode through an `ArenaPool`: K/V in pages, state in slots, batched decode
gathering and scattering each Mamba layer's state) and transformers' `generate` with its own cache,
on the same prompts, at batch 1 and batch 8 (equal-length prompts, so `generate` needs no padding).

Per-token decode time is (time to generate 1 + N tokens - time to generate 1 token) / N, so both sides
pay their prefill alike and only the decode steps count. The two sides alternate within each repeat
(same warm caches, same load on the machine). A figure takes the fastest whole run less the fastest
first token over the repeats (`--stat median`: the median of each repeat's difference; the JSON has
both, with the spread). Both sides run on one torch thread, timed on its CPU time (`--clock wall`
for wall time; both are in the JSON), so other work on a shared machine does not decide the
ratios. Of each step's CPU time, the part inside the model's forward is measured apart from the
loop around it (the pool's and the runner's bookkeeping, or `generate`'s), at batch 8. State bytes
per step: what the runner gathered and scattered per batched decode step.

    .venv/bin/python scripts/bench_model.py --quick --json out/bench_model.json

Keys: `models` -> per architecture `pooled_ms_per_token_b1`, `hf_ms_per_token_b1`,
`pooled_tokens_per_s_b8`, `hf_tokens_per_s_b8`, `state_copy_bytes_per_step_b8`, with the two ratios,
`ms_per_step_b8_in_model` / `ms_per_step_b8_around_model` per side, and `detail` (every clock, spreads,
whether both sides generated the same tokens).
Targets: pooled / hf latency at batch 1 <= 1.5; pooled throughput at batch 8 >= 0.8x hf's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from distpool.memory.arena_pool import ArenaPool  # noqa: E402
from distpool.memory.sizing import PoolArgs, size_pools  # noqa: E402
from distpool.model_impl.hf.oracle import load_oracle  # noqa: E402
from distpool.model_impl.hf.runner import TransformersRunner  # noqa: E402
from distpool.model_impl.hf.tiny import TINY_CONFIGS, VOCAB, save_checkpoint  # noqa: E402
from distpool.model_impl.select import resolve_implementation  # noqa: E402

# ---- parameters ----------------------------------------------------------------------------------
SEED = 7
DTYPE = "float32"
PROMPT_LEN = 32
BATCHES = (1, 8)
PAGE_SIZE = 16
NEW_TOKENS = {"quick": 24, "full": 64}  # decode steps after the first token
REPEATS = {"quick": 5, "full": 9}
# Tiny dims leave each op microseconds of work: more threads add only their handoffs, and on a shared
# machine they wait for cores (a 2-core machine under load ran transformers' conv 5x slower on 2).
THREADS = 1
# The clocks every run is timed on: the thread's CPU time (what the work costs, whatever else the
# machine runs: with one thread, the computation is all on it) and wall time (what a caller waits).
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
# How the repeats make one figure: the fastest (see `spread`), or their median.
STATS = ("fastest", "median")
TARGET_LATENCY_RATIO = 1.5  # pooled / hf ms per token at batch 1, at most
TARGET_THROUGHPUT_RATIO = 0.8  # pooled / hf tokens per second at batch 8, at least


def prompts(batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(VOCAB, (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)]


def hf_generate(model, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate`, its own cache, the whole batch at once."""
    ids = torch.tensor(batch)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :].tolist()


class InModel:
    """CPU seconds spent inside one model's forward calls (hooks on its top module), summed: the
    rest of a step is its loop's own work (`generate`'s, or the pool's and the runner's)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds, self._entered = 0.0, 0.0
        model.register_forward_pre_hook(lambda *_: self._enter())
        model.register_forward_hook(lambda *_: self._leave())

    def _enter(self) -> None:
        self._entered = time.thread_time()

    def _leave(self) -> None:
        self.seconds += time.thread_time() - self._entered


def timed(run: Callable[[], object], in_model: InModel) -> dict[str, float]:
    """Seconds `run` took on each clock, and of its CPU time the part inside the model."""
    started = {name: clock() for name, clock in CLOCKS.items()} | {"cpu_in_model": in_model.seconds}
    run()
    ended = {name: clock() for name, clock in CLOCKS.items()} | {"cpu_in_model": in_model.seconds}
    return {name: ended[name] - started[name] for name in started}


def inside(figures: dict, side: str, stat: str) -> float:
    return figures["per_step_s"]["cpu_in_model"][side][stat]


def spread(wholes: list[float], firsts: list[float], steps: int) -> dict:
    """Seconds per decode step: `fastest` from the fastest whole run and the fastest first token (what
    the work costs when nothing else interferes, as `timeit` takes it), and the median, min and max
    of the repeats' own differences."""
    each = [(whole - first) / steps for whole, first in zip(wholes, firsts, strict=True)]
    fastest = (min(wholes) - min(firsts)) / steps
    return {"fastest": fastest, "median": statistics.median(each), "min": min(each), "max": max(each)}


def bench_arch(folder: Path, steps: int, repeats: int, clock: str, stat: str) -> dict:
    impl = resolve_implementation(folder / "config.json", "transformers", dtype=DTYPE)
    runner = TransformersRunner(impl.spec, impl.hf, seed=SEED)
    oracle = load_oracle(impl.hf, seed=SEED)
    args = PoolArgs(page_size=PAGE_SIZE, context_len=PROMPT_LEN + steps + 1, enable_unified_memory=True)
    pool = ArenaPool(size_pools(impl.spec, args, 64 << 20), "cpu")
    in_model = InModel(runner.model), InModel(oracle)
    out: dict = {}
    for batch in BATCHES:
        batch_prompts = prompts(batch)
        sides = {
            "pooled": lambda n, p=batch_prompts: runner.generate(pool, p, n),
            "hf": lambda n, p=batch_prompts: hf_generate(oracle, p, n),
        }
        counted = {"pooled": in_model[0], "hf": in_model[1]}
        tokens = {name: run(steps + 1) for name, run in sides.items()}  # warm-up, and the tokens
        figures = [*CLOCKS, "cpu_in_model"]
        # clock -> side -> seconds of each repeat's whole run (1 + steps tokens) and first token
        wholes = {c: {name: [] for name in sides} for c in figures}
        firsts = {c: {name: [] for name in sides} for c in figures}
        before = runner.copies.bytes, runner.copies.gathers
        for _ in range(repeats):
            for name, run in sides.items():  # alternating: both sides see the same machine
                whole = timed(lambda r=run: r(steps + 1), counted[name])
                first = timed(lambda r=run: r(1), counted[name])
                for c in figures:
                    wholes[c][name].append(whole[c])
                    firsts[c][name].append(first[c])
        moved, gathers = runner.copies.bytes - before[0], runner.copies.gathers - before[1]
        out[f"b{batch}"] = {
            "per_step_s": {
                c: {name: spread(wholes[c][name], firsts[c][name], steps) for name in sides} for c in figures
            },
            "tokens_equal": tokens["pooled"] == tokens["hf"],
            # gathered and scattered per batched step (a batch of one works on its slot in place)
            "state_copy_bytes_per_step": moved / (repeats * steps),
            "state_gathers_per_step": gathers / (repeats * steps),
        }
    b1, b8 = out["b1"]["per_step_s"][clock], out["b8"]["per_step_s"][clock]
    return {
        "pooled_ms_per_token_b1": 1e3 * b1["pooled"][stat],
        "hf_ms_per_token_b1": 1e3 * b1["hf"][stat],
        "pooled_tokens_per_s_b8": 8 / b8["pooled"][stat],
        "hf_tokens_per_s_b8": 8 / b8["hf"][stat],
        "state_copy_bytes_per_step_b8": out["b8"]["state_copy_bytes_per_step"],
        "latency_ratio_b1": b1["pooled"][stat] / b1["hf"][stat],
        "throughput_ratio_b8": b8["hf"][stat] / b8["pooled"][stat],
        # where a batch-8 step's CPU time goes: inside the model's forward, and around it
        "ms_per_step_b8_in_model": {side: 1e3 * inside(out["b8"], side, stat) for side in ("pooled", "hf")},
        "ms_per_step_b8_around_model": {
            side: 1e3 * (out["b8"]["per_step_s"]["cpu"][side][stat] - inside(out["b8"], side, stat))
            for side in ("pooled", "hf")
        },
        "detail": out,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{NEW_TOKENS['quick']} tokens, fewer repeats")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--arch", action="append", choices=list(TINY_CONFIGS), help="(default: all six)")
    parser.add_argument("--threads", type=int, default=THREADS, help="torch threads, both sides alike")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu", help="the clock the figures use")
    parser.add_argument("--stat", choices=STATS, default=STATS[0], help="the estimate the figures use")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mode = "quick" if args.quick else "full"
    steps, repeats = NEW_TOKENS[mode], REPEATS[mode]
    torch.manual_seed(SEED)
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch or list(TINY_CONFIGS):
            folder = save_checkpoint(arch, Path(tmp) / arch, seed=SEED)
            models[arch] = bench_arch(folder, steps, repeats, args.clock, args.stat)
            print(f"bench_model: {arch} done", flush=True)
    print(
        f"\n{'arch':<18}{'b1 pooled ms':>13}{'b1 hf ms':>10}{'ratio':>7}"
        f"{'b8 pooled tok/s':>17}{'b8 hf tok/s':>13}{'ratio':>7}{'state B/step b8':>17}{'equal':>7}"
    )
    for arch, m in models.items():
        equal = m["detail"]["b1"]["tokens_equal"] and m["detail"]["b8"]["tokens_equal"]
        print(
            f"{arch:<18}{m['pooled_ms_per_token_b1']:>13.2f}{m['hf_ms_per_token_b1']:>10.2f}"
            f"{m['latency_ratio_b1']:>7.2f}{m['pooled_tokens_per_s_b8']:>17.0f}{m['hf_tokens_per_s_b8']:>13.0f}"
            f"{m['throughput_ratio_b8']:>7.2f}{m['state_copy_bytes_per_step_b8']:>17,.0f}{str(equal):>7}"
        )
    print(f"\nbatch 8, CPU ms per step{'pooled: in model':>22}{'around':>8}{'hf: in model':>15}{'around':>8}")
    for arch, m in models.items():
        inner, outer = m["ms_per_step_b8_in_model"], m["ms_per_step_b8_around_model"]
        print(
            f"{arch:<24}{inner['pooled']:>22.2f}{outer['pooled']:>8.2f}{inner['hf']:>15.2f}{outer['hf']:>8.2f}"
        )
    met = all(
        m["latency_ratio_b1"] <= TARGET_LATENCY_RATIO and m["throughput_ratio_b8"] >= TARGET_THROUGHPUT_RATIO
        for m in models.values()
    )
    print(
        f"targets (b1 latency ratio <= {TARGET_LATENCY_RATIO}, b8 throughput ratio >= "
        f"{TARGET_THROUGHPUT_RATIO}): {'met' if met else 'missed'}"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        params = {
            "dtype": DTYPE,
            "threads": args.threads,
            "clock": args.clock,
            "stat": args.stat,
            "prompt_len": PROMPT_LEN,
            "new_tokens": steps + 1,
            "repeats": repeats,
        }
        Path(args.json).write_text(
            json.dumps({"params": params, "targets_met": met, "models": models}, indent=2)
        )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
