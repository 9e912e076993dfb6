"""Prefill's prefix cache on what users share most, served 1P1D through the whole stack.

Two workloads, each on a fresh embedded Ray cluster:
- `shared-prefix`: `distpool run --model nemotron-h-8b --workload shared-prefix --requests 16
  --memory-gib 3` (synthetic cache, every byte verified at decode): one system prompt, then each
  request's own part;
- `identical`: 48 identical prompts of 64 tokens (a whole number of pages) on the reference model,
  whose tokens are compared with its no-cache oracle.

Per request (in request order) it prints the prompt's tokens, the part it shares with the others
and the tokens prefill found cached; per workload, how many requests hit at least half of the shared
part, and the checkpoints the prefill pool holds at the end with their bytes.

    .venv/bin/python scripts/bench_prefix.py --json out/bench_prefix.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from distpool.memory.sizing import GIB, PoolArgs, size_pools  # noqa: E402
from distpool.model.hf_config import spec_from_hf  # noqa: E402
from distpool.model.presets import resolve_model  # noqa: E402
from distpool.model.sampling import SamplingParams  # noqa: E402
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG  # noqa: E402
from distpool.model_impl.reference.model import ReferenceModel  # noqa: E402
from distpool.serving.deploy.deployment import Deployment, DeploymentSpec  # noqa: E402
from distpool.serving.job.main import worker_stats  # noqa: E402
from distpool.serving.path.driver import ServeOptions, Server  # noqa: E402
from distpool.serving.workloads import workload  # noqa: E402
from distpool.serving.workloads.workload import Request  # noqa: E402
from distpool.worker.config import WorkerConfig  # noqa: E402
from distpool.worker.stats import DecodeStats, PrefillStats  # noqa: E402

# ---- parameters ----------------------------------------------------------------------------------
SEED = 0
MAX_NEW_TOKENS = 16  # `distpool run`'s default
SHARED = {"model": "nemotron-h-8b", "requests": 16, "memory_gib": 3.0, "model_impl": "synthetic"}
IDENTICAL = {"requests": 48, "prompt_tokens": 64, "memory_gib": 0.25, "model_impl": "reference"}


def shared_prefix_case() -> tuple[WorkerConfig, list[Request]]:
    spec = spec_from_hf(resolve_model(SHARED["model"]))
    config = WorkerConfig(
        spec=spec,
        pool_args=PoolArgs(enable_unified_memory=True),  # what `run` resolves for hybrid Mamba
        budget_bytes=int(SHARED["memory_gib"] * GIB),
        model_impl=SHARED["model_impl"],
        seed=SEED,
    )
    requests = workload.generate(
        SHARED["requests"],
        vocab_size=spec.vocab_size,
        max_new_tokens=MAX_NEW_TOKENS,
        seed=SEED,
        workload="shared-prefix",
    )
    return config, requests


def identical_case() -> tuple[WorkerConfig, list[Request]]:
    spec = spec_from_hf(REFERENCE_HYBRID_CONFIG)
    config = WorkerConfig(
        spec=spec,
        pool_args=PoolArgs(enable_unified_memory=True),
        budget_bytes=int(IDENTICAL["memory_gib"] * GIB),
        model_impl=IDENTICAL["model_impl"],
        seed=SEED,
    )
    prompt = [(7 * t + 3) % spec.vocab_size for t in range(IDENTICAL["prompt_tokens"])]
    requests = [
        Request(request_id=f"req-{i:05d}", prompt=prompt, params=SamplingParams(max_tokens=MAX_NEW_TOKENS))
        for i in range(IDENTICAL["requests"])
    ]
    return config, requests


def shared_tokens(requests: list[Request]) -> int:
    """Tokens every prompt holds alike from the start."""
    first, shared = requests[0].prompt, min(len(r.prompt) for r in requests)
    for r in requests[1:]:
        shared = next((i for i in range(shared) if r.prompt[i] != first[i]), shared)
    return shared


def serve_case(name: str, config: WorkerConfig, requests: list[Request]) -> dict:
    spec = DeploymentSpec(worker=config)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        deployment = Deployment.start(spec)
        try:
            server = Server(deployment, ServeOptions(progress=False, seed=SEED))
            outcomes = asyncio.run(server.serve(requests))
            readings = worker_stats(deployment)
        finally:
            deployment.shutdown()
    finally:
        ray.shutdown()
    by_id = {o.request_id: o for o in outcomes}
    failed = [o.error for o in outcomes if o.tokens is None]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} requests failed: {failed[:3]}")
    if unread := [f"{w.name}: {w.state}" for w in readings if w.stats is None]:
        raise RuntimeError(f"{name}: workers not read at the end: {unread}")
    prefill = [w.stats for w in readings if isinstance(w.stats, PrefillStats)]
    decode = [w.stats for w in readings if isinstance(w.stats, DecodeStats)]
    mismatches = 0
    if config.model_impl == "reference":  # token parity with the no-cache oracle
        oracle = ReferenceModel(config.spec, seed=config.seed)
        expected = {r.request_id: oracle.generate_nocache(r.prompt, r.max_new_tokens) for r in requests}
        mismatches = sum(expected[rid] != o.tokens for rid, o in by_id.items())
    shared = shared_tokens(requests)
    hits = [by_id[r.request_id].prompt_tokens - by_id[r.request_id].prefill_tokens_computed for r in requests]
    slot_stride = size_pools(config.spec, config.for_role("prefill"), config.budget_bytes).slot_stride_bytes
    checkpoints = sum(s.checkpoints for s in prefill)
    return {
        "workload": name,
        "requests": len(requests),
        "shared_tokens": shared,
        "prompt_tokens": [len(r.prompt) for r in requests],
        "hit_tokens": hits,
        "hit_at_least_half_shared": sum(h >= shared / 2 for h in hits),
        "prefill_tokens_computed": sum(o.prefill_tokens_computed for o in outcomes),
        "checkpoints_at_end": checkpoints,
        "checkpoint_bytes_at_end": checkpoints * slot_stride,
        "evicted_checkpoints": sum(s.evicted_checkpoints for s in prefill),
        "verified_envelopes": sum(s.verified_envelopes for s in decode),
        "corrupt_envelopes": sum(s.corrupt_envelopes for s in decode),
        "oracle_mismatches": mismatches,
    }


def print_case(row: dict) -> None:
    print(f"\n{row['workload']}: {row['requests']} requests, {row['shared_tokens']} tokens shared by all")
    print(f"{'request':>8} {'prompt':>7} {'hit':>6}")
    for i, (tokens, hit) in enumerate(zip(row["prompt_tokens"], row["hit_tokens"], strict=True)):
        print(f"{i:>8} {tokens:>7} {hit:>6}")
    print(
        f"hit >= half the shared part: {row['hit_at_least_half_shared']} of {row['requests']}; "
        f"prefill computed {row['prefill_tokens_computed']} tokens; checkpoints at the end "
        f"{row['checkpoints_at_end']} ({row['checkpoint_bytes_at_end'] / 2**20:.2f} MiB), "
        f"{row['evicted_checkpoints']} evicted; envelopes verified / corrupt "
        f"{row['verified_envelopes']} / {row['corrupt_envelopes']}; "
        f"oracle mismatches {row['oracle_mismatches']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=["shared-prefix", "identical"], default=None)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    cases = {"shared-prefix": shared_prefix_case, "identical": identical_case}
    rows = []
    for name, make in cases.items():
        if args.only in (None, name):
            rows.append(serve_case(name, *make()))
            print_case(rows[-1])
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"seed": SEED, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
