"""Fault soak: PD serving (2P2D, reference model) while faults of six kinds strike many times.

Kinds: the five of `distpool.serving.path.faults` (sender abort mid-stream, a sender stalled past the
deadline, a delayed control message, a payload byte flipped on landing, which the transfer
checksum must catch, and decode cancelling mid-transfer), drawn per attempt, plus worker processes
killed with SIGKILL (Ray restarts them). Every completed request is re-generated colocated and
compared token for token: a mismatch is a corrupt envelope that was accepted.

    .venv/bin/python scripts/soak.py --quick --json out/soak.json

Targets: every request completes or fails with a failure kind, 0 leaked pages or slots, 0 corrupt
envelopes accepted; --quick injects at least 500 faults within five minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from distpool.memory.sizing import PoolArgs  # noqa: E402
from distpool.model.hf_config import spec_from_hf  # noqa: E402
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG  # noqa: E402
from distpool.serving.deploy.deployment import Deployment, DeploymentSpec  # noqa: E402
from distpool.serving.job.main import worker_stats  # noqa: E402
from distpool.serving.path.driver import ServeOptions, Server  # noqa: E402
from distpool.serving.summary.parity import colocated_tokens  # noqa: E402
from distpool.serving.summary.report import failures_by_reason, leak_counts  # noqa: E402
from distpool.serving.workloads import workload  # noqa: E402
from distpool.worker.config import WorkerConfig  # noqa: E402
from transfer import TransferOptions  # noqa: E402

# ---- parameters ----------------------------------------------------------------------------------
SEED = 7
QUICK_REQUESTS, FULL_REQUESTS = 600, 3000
QUICK_KILLS, FULL_KILLS = 2, 4  # SIGKILLs, alternating prefill and decode workers
FAULT_RATES = {  # per attempt
    "sender_abort": 0.12,
    "stall": 0.04,  # each costs a transfer timeout and a channel rebuild
    "delay_control": 0.12,
    "corrupt_payload": 0.12,
    "receiver_cancel": 0.12,
}
TRANSFER_TIMEOUT_S = 1.0
MAX_NEW_TOKENS = 6


def make_spec() -> DeploymentSpec:
    worker = WorkerConfig(
        spec=spec_from_hf(REFERENCE_HYBRID_CONFIG),
        pool_args=PoolArgs(page_size=4, context_len=256),
        budget_bytes=16 << 20,
        transfer=TransferOptions(timeout_s=TRANSFER_TIMEOUT_S, checksum=True),
        device="cpu",
    )
    return DeploymentSpec.build(worker, num_prefill=2, num_decode=2)


def killer(deployment: Deployment, server: Server, total: int, kills: int, killed: list[str]) -> None:
    """Kill a worker process each time another 1/(kills+1) of the requests is done."""
    victims = ["prefill-0", "decode-1", "prefill-1", "decode-0"]
    for k in range(kills):
        while server.done < total * (k + 1) / (kills + 1):
            time.sleep(0.05)
            if server.done >= total:
                return
        name = victims[k % len(victims)]
        try:
            os.kill(ray.get(deployment.handles()[name].pid.remote(), timeout=30), signal.SIGKILL)
            killed.append(name)
        except Exception as exc:  # it is restarting from an earlier kill: skip this one
            print(f"  soak: could not kill {name}: {exc}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_REQUESTS} requests, {QUICK_KILLS} kills"
    )
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--kills", type=int, default=None)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    total = args.requests or (QUICK_REQUESTS if args.quick else FULL_REQUESTS)
    kills = args.kills if args.kills is not None else (QUICK_KILLS if args.quick else FULL_KILLS)
    requests = workload.generate(
        total, vocab_size=96, min_prompt=1, max_prompt=40, max_new_tokens=MAX_NEW_TOKENS, seed=SEED
    )
    spec = make_spec()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    started = time.monotonic()
    deployment = Deployment.start(spec)
    killed: list[str] = []
    try:
        server = Server(deployment, ServeOptions(faults=FAULT_RATES, max_attempts=8, seed=SEED))
        thread = threading.Thread(target=killer, args=(deployment, server, total, kills, killed), daemon=True)
        thread.start()
        outcomes = asyncio.run(server.serve(requests))
        stats = worker_stats(deployment)
    finally:
        deployment.shutdown()
    serve_s = time.monotonic() - started
    done = {o.request_id: o.tokens for o in outcomes if o.tokens is not None}
    expected = colocated_tokens(spec, [r for r in requests if r.request_id in done])
    ray.shutdown()
    kinds = dict(server.faults.injected) | {"worker_kill": len(killed)}
    result = {
        "requests": total,
        "completed": len(done),
        "failed": total - len(done),
        "failures_by_reason": failures_by_reason(outcomes),
        "unexplained_failures": sum(1 for o in outcomes if o.tokens is None and o.failure is None),
        "faults_injected": sum(kinds.values()),
        "kinds": kinds,
        # of the faults drawn, those a transfer took (an attempt that found no room took none)
        "struck": dict(server.faults.struck),
        "retried": server.retried,
        "workers_lost": len(server.recovery.lost),
        "workers_restarted": len(server.recovery.restarted),
        **leak_counts(stats),
        "corrupt_accepted": sum(expected[rid] != tokens for rid, tokens in done.items()),
        "serve_s": round(serve_s, 1),
    }
    width = max(map(len, result))
    print("\nfault soak")
    for key, value in result.items():
        print(f"  {key:<{width}}  {value}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    # A worker left dead reads as unknown leaks (None): not counted as leaks, listed as unchecked.
    healthy = not result["leaked_pages"] and not result["leaked_slots"] and result["corrupt_accepted"] == 0
    return 0 if healthy and result["unexplained_failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
