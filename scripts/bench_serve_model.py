"""What one prefill and one decode step cost for a config under the transformers runner, no Ray.

The serving benchmark's model (`distpool/model_impl/reference/configs/bench-bamba.json`: a Bamba-style
config served with `--model-impl transformers --load-format dummy`) is sized so that one prefill costs
tens of decode steps on a CPU; this script says how many. It loads the runner with seeded random
weights in float32 with torch's threads (`--threads`; a distpool worker keeps torch's default), then
times, on wall time (`--clock cpu`: the main thread's CPU time, with `--threads 1` the whole
computation's), the fastest of `--repeats`:

- prefill of one prompt of each `--prompt-len` and its first token (the runner prefills one request
  at a time);
- a decode step at each `--batch`, as (time of 1 + N tokens - time of 1 token) / N.

    .venv/bin/python scripts/bench_serve_model.py --json out/bench_serve_model.json

Keys: `parameters`, `layers`, `attention_layers`, `hidden_size`, `prefill_ms` (prompt length ->
ms), `decode_step_ms` (batch -> ms), `prefill_in_decode_steps` (prompt length -> prefill over the
batch-1 step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from distpool.memory.arena_pool import ArenaPool  # noqa: E402
from distpool.memory.sizing import PoolArgs, size_pools  # noqa: E402
from distpool.model_impl.hf.runner import TransformersRunner  # noqa: E402
from distpool.model_impl.reference.configs import BENCH_BAMBA_CONFIG  # noqa: E402
from distpool.model_impl.select import resolve_implementation  # noqa: E402

SEED = 0
PAGE_SIZE = 16
STEPS = 16  # decode steps after the first token
POOL_BYTES = 256 << 20
# wall: what a caller waits (other work on a shared machine included); cpu: the thread's CPU time (the
# computation is all on its one thread), what the work costs whatever else the machine runs.
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(min(vocab, 96), (length,), generator=gen).tolist() for _ in range(batch)]


def fastest(run, repeats: int, clock) -> float:
    """The fastest time of `repeats` calls of `run` on `clock`, after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        started = clock()
        run()
        times.append(clock() - started)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=str(BENCH_BAMBA_CONFIG), help="a config.json or checkpoint folder"
    )
    parser.add_argument("--prompt-len", type=int, action="append", help="(default: 64 and 512)")
    parser.add_argument("--batch", type=int, action="append", help="decode batches (default: 1 and 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's, as in a worker)",
    )
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="the clock the figures use")
    parser.add_argument("--json", default=None, metavar="PATH")
    ns = parser.parse_args()
    lengths, batches = ns.prompt_len or [64, 512], ns.batch or [1, 8]
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    impl = resolve_implementation(Path(ns.config), "transformers", load_format="dummy", dtype="float32")
    runner = TransformersRunner(impl.spec, impl.hf, seed=SEED)
    config = runner.model.config
    context = max(lengths) + STEPS + 2
    pool = ArenaPool(
        size_pools(impl.spec, PoolArgs(page_size=PAGE_SIZE, context_len=context), POOL_BYTES), "cpu"
    )
    vocab = config.vocab_size
    clock = CLOCKS[ns.clock]
    prefill_ms = {
        n: 1e3 * fastest(lambda n=n: runner.generate(pool, prompts(1, n, vocab), 1), ns.repeats, clock)
        for n in lengths
    }
    decode_ms = {}
    for b in batches:
        batch = prompts(b, 16, vocab)
        whole = fastest(lambda p=batch: runner.generate(pool, p, STEPS + 1), ns.repeats, clock)
        first = fastest(lambda p=batch: runner.generate(pool, p, 1), ns.repeats, clock)
        decode_ms[b] = 1e3 * (whole - first) / STEPS
    out = {
        "config": ns.config,
        "parameters": sum(p.numel() for p in runner.model.parameters()),
        "layers": config.num_hidden_layers,
        "attention_layers": len(config.attn_layer_indices or []),
        "hidden_size": config.hidden_size,
        "threads": torch.get_num_threads(),
        "clock": ns.clock,
        "prefill_ms": prefill_ms,
        "decode_step_ms": decode_ms,
        "prefill_in_decode_steps": {n: ms / decode_ms[batches[0]] for n, ms in prefill_ms.items()},
    }
    print(json.dumps(out, indent=2))
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
