"""The churn trace shared by the benchmarks: seeded Poisson arrivals with long-tailed prompt and
output lengths, offered at TRACE_LOAD of the arena (with the queue, the pool stays 80-95% full);
each request reserves its prompt, grows by its output in GROWTH_STEPS extends and leaves.

`run_churn` drives a pool through one trace. By default it drains the pool (every request leaves;
scripts/bench_pool.py, section d). With a `target`, one extra request of a chosen length arrives
part-way through, grows like the others and stays: the trace stops once it is fully grown, with it
and the rest of that moment's requests still live, so their real placements can be read
(`pool.envelope_ranges`; scripts/bench_transfer.py, `--fragmented churn`).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from distpool.memory.arena_pool import ArenaPool, build_pool  # noqa: E402
from distpool.memory.pool import DoesNotFit  # noqa: E402
from distpool.memory.sizing import PoolArgs, size_pools  # noqa: E402
from distpool.model.hf_config import spec_from_hf  # noqa: E402
from distpool.model.spec import ModelSpec, StateTensorSpec  # noqa: E402

QWEN3_NEXT = REPO / "tests/fixtures/qwen3_next.json"
PAGE_SIZE = 16
MAX_RUNNING = 100_000  # high enough that no pool is capped by a request count
TRACE_CONTEXT_LEN = 131072
TRACE_LOAD = 0.85  # offered bytes over arena bytes: with the queue, the pool stays 80-95% full
GROWTH_STEPS = 4  # a request's output arrives in this many extends
TARGET_ID = "target"


def trace_spec(ssm_heads: int) -> ModelSpec:
    """Qwen3-Next with `ssm_heads` SSM heads per layer: its slot grows ~1.4 MB per head."""
    base = spec_from_hf(QWEN3_NEXT)
    conv, ssm = base.mamba.tensors
    tensors = (conv, StateTensorSpec(name=ssm.name, shape=(ssm_heads, *ssm.shape[1:]), dtype=ssm.dtype))
    return dataclasses.replace(base, mamba=dataclasses.replace(base.mamba, tensors=tensors))


def trace_pool(
    spec: ModelSpec, budget: int, placement: str, context_len: int = TRACE_CONTEXT_LEN, device: str = "meta"
) -> ArenaPool:
    """A unified pool of `budget` bytes for a churn trace (on `meta`: ids and accounting only)."""
    args = PoolArgs(
        enable_unified_memory=True,
        page_size=PAGE_SIZE,
        context_len=context_len,
        max_running_requests=MAX_RUNNING,
    )
    return build_pool(size_pools(spec, args, budget), device, placement=placement)


def envelope_runs(pool: ArenaPool, rid: str) -> int:
    """Byte runs of the envelope: the slot, plus each maximal stretch of token-order pages at
    consecutive ascending positions."""
    pages = pool.page_ids(rid)
    breaks = int((pages[1:] != pages[:-1] + 1).sum()) if pages.numel() > 1 else 0
    return 1 + (breaks + 1 if pages.numel() else 0)


def run_churn(
    pool: ArenaPool,
    num_requests: int,
    seed: int,
    *,
    context_len: int = TRACE_CONTEXT_LEN,
    target: tuple[int, int] | None = None,
) -> dict:
    """Drive `pool` through one churn trace of `num_requests` requests (ids "q0", "q1", ...).

    target: (final tokens, arrival index): request TARGET_ID arrives with request `index`, reserves
    7/8 of its tokens, grows by the rest in GROWTH_STEPS extends and never leaves; when it cannot
    grow, the newest other requests are preempted until it can. The trace stops once it is fully
    grown (the others that are live then stay live); without a target, it runs until every
    request has left.

    Returns the trace's counts: refused_with_room (reserves or extends refused while the arena's
    free bytes covered them), preempted, runs (of each envelope as it left), occupancy (after the
    warm-up), envelope_bytes_mean (the trace's mean envelope: slot plus the pages of the prompt and
    half the output) and, with a target, target_preempted (requests preempted to let it grow).
    """
    slot_bytes, page_bytes = pool.arena.low.stride_bytes, pool.arena.high.stride_bytes
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(math.log(2048), 1.2, num_requests).astype(int), 16, context_len // 2)
    output = np.clip(rng.lognormal(math.log(256), 1.0, num_requests).astype(int), 1, context_len // 2)
    hold = 1.0 + output / 100.0  # time in the pool: a fixed part plus decode time per token
    mean_bytes = float(np.mean(slot_bytes + np.ceil((prompt + output / 2) / PAGE_SIZE) * page_bytes))
    rate = TRACE_LOAD * pool.sizes.arena_bytes / (mean_bytes * float(np.mean(hold)))  # Little's law
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    names = [f"q{i}" for i in range(num_requests)]
    target_at = -1
    if target is not None:  # index num_requests: grows over a typical request's time, never leaves
        target_tokens, target_at = target
        target_output = max(1, target_tokens // 8)
        prompt = np.append(prompt, target_tokens - target_output)
        output = np.append(output, target_output)
        hold = np.append(hold, float(np.mean(hold)))
        names.append(TARGET_ID)
    events: list[tuple[float, int, int, int]] = []  # (time, kind 0 grow / 1 leave, request, step)
    queue: list[int] = []
    tokens: dict[int, int] = {}  # live requests, in the order they were admitted
    live = 0
    grown = 0  # growth steps the target has taken
    stats = {
        "refused_with_room": 0,
        "preempted": 0,
        "runs": [],
        "occupancy": [],
        "target_preempted": 0,
        "envelope_bytes_mean": mean_bytes,
    }

    def held_bytes(n: int) -> int:
        return slot_bytes + -(-n // PAGE_SIZE) * page_bytes

    def leave(i: int) -> None:
        nonlocal live
        stats["runs"].append(envelope_runs(pool, names[i]))
        pool.release(names[i])
        live -= held_bytes(tokens.pop(i))

    def admit(now: float) -> None:
        nonlocal live
        while queue:
            i = queue[0]
            need = held_bytes(int(prompt[i]))
            try:
                pool.reserve(names[i], int(prompt[i]), compact=True, final_tokens=int(prompt[i] + output[i]))
            except DoesNotFit:
                stats["refused_with_room"] += int(pool.sizes.arena_bytes - live >= need)
                return
            queue.pop(0)
            tokens[i], live = int(prompt[i]), live + need
            for step in range(1, GROWTH_STEPS + 1):
                heapq.heappush(events, (now + hold[i] * step / (GROWTH_STEPS + 1), 0, i, step))
            if i != num_requests or target is None:
                heapq.heappush(events, (now + hold[i], 1, i, 0))

    def grow_target(more: int) -> None:
        """Extend the target by `more`, preempting the newest other requests until it fits."""
        while True:
            try:
                pool.extend(TARGET_ID, more, compact=True)
                return
            except DoesNotFit:
                newest = [j for j in tokens if j != num_requests]
                if not newest:
                    raise
                leave(newest[-1])
                stats["target_preempted"] += 1

    next_arrival = 0
    while next_arrival < num_requests or events:
        if next_arrival < num_requests and (not events or arrivals[next_arrival] <= events[0][0]):
            now = float(arrivals[next_arrival])
            queue.append(next_arrival)
            if next_arrival == target_at:
                queue.append(num_requests)
            next_arrival += 1
        else:
            now, kind, i, step = heapq.heappop(events)
            if i not in tokens:  # preempted earlier
                continue
            if kind == 1:
                leave(i)
            else:
                more = int(output[i]) * step // GROWTH_STEPS - int(output[i]) * (step - 1) // GROWTH_STEPS
                grown_bytes = held_bytes(tokens[i] + more) - held_bytes(tokens[i])
                if target is not None and i == num_requests:
                    grow_target(more)
                    tokens[i], live, grown = tokens[i] + more, live + grown_bytes, grown + 1
                else:
                    try:
                        pool.extend(names[i], more, compact=True)
                        tokens[i], live = tokens[i] + more, live + grown_bytes
                    except DoesNotFit:  # no room to grow: the request is preempted (freed)
                        stats["refused_with_room"] += int(pool.sizes.arena_bytes - live >= grown_bytes)
                        stats["preempted"] += 1
                        leave(i)
        admit(now)
        if next_arrival > num_requests // 10:  # after the warm-up
            stats["occupancy"].append(live / pool.sizes.arena_bytes)
        if target is not None and grown == GROWTH_STEPS:
            break
    if target is not None and grown < GROWTH_STEPS:
        raise RuntimeError(f"the churn trace ended before its {target[0]}-token target was fully grown")
    pool.check_invariants()
    return stats
