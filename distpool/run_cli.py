"""`distpool run`: the main job. Serves a workload through PD on Ray and prints a summary.

With no address it starts an embedded local Ray; inside a Ray job (RAY_ADDRESS is set by
`ray job submit`) or with `--address` it attaches to that cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import TYPE_CHECKING

from distpool import workload
from distpool.cli import add_pool_arguments, pool_args_from
from distpool.configs import REFERENCE_CONFIG
from distpool.configurator import GIB
from distpool.settings import Settings

if TYPE_CHECKING:
    from distpool.launcher import DeploymentSpec


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="serve a workload through prefill/decode disaggregation on Ray")
    run.add_argument(
        "--model", default=str(REFERENCE_CONFIG), help="model config.json (reference by default)"
    )
    run.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    run.add_argument("--decode", type=int, default=1, help="number of decode workers")
    run.add_argument("--requests", type=int, default=32, help="generated requests (ignored with --prompts)")
    run.add_argument("--prompts", default=None, help="JSONL file of prompts instead of a generated workload")
    run.add_argument("--min-prompt-len", type=int, default=4)
    run.add_argument("--max-prompt-len", type=int, default=96)
    run.add_argument("--max-new-tokens", type=int, default=16)
    run.add_argument(
        "--fault-rate", type=float, default=0.0, help="probability a transfer is aborted mid-stream"
    )
    run.add_argument(
        "--parity-sample", type=int, default=4, help="requests re-generated colocated and compared"
    )
    run.add_argument("--memory-gib", type=float, default=0.25, help="pool budget per worker")
    run.add_argument(
        "--disable-unified-memory", action="store_true", help="static pools even for hybrid Mamba"
    )
    run.add_argument(
        "--device", default="auto", help="auto (a GPU per worker when there are enough), cpu, cuda"
    )
    run.add_argument("--spread", action="store_true", help="place every worker on a different node")
    run.add_argument(
        "--address", default=None, help="Ray cluster to attach to (default: RAY_ADDRESS or embedded)"
    )
    run.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded Ray cluster")
    run.add_argument(
        "--transfer-timeout", type=float, default=None, help="seconds; default DISTPOOL_TRANSFER_TIMEOUT_S"
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", default=None, metavar="PATH", help="write the summary as JSON")
    add_pool_arguments(run)
    run.set_defaults(handler=cmd_run)


def deployment_spec(ns: argparse.Namespace, settings: Settings) -> DeploymentSpec:
    from distpool.launcher import DeploymentSpec

    unified = True if ns.enable_unified_memory else (False if ns.disable_unified_memory else None)
    return DeploymentSpec(
        model_config=ns.model,
        num_prefill=ns.prefill,
        num_decode=ns.decode,
        pool_args=pool_args_from(ns, None),
        unified=unified,
        budget_bytes=int(ns.memory_gib * GIB),
        device=ns.device,
        spread=ns.spread,
        seed=ns.seed,
        transfer_timeout_s=ns.transfer_timeout or settings.transfer_timeout_s,
        chunk_bytes=settings.chunk_mib << 20,
    )


def cmd_run(ns: argparse.Namespace) -> int:
    import ray

    from distpool.launcher import Deployment
    from distpool.parity import check_parity
    from distpool.report import format_summary, summarize
    from distpool.serve import ServeOptions, Server

    if not 0.0 <= ns.fault_rate < 1.0:
        raise ValueError(f"--fault-rate must be in [0, 1); got {ns.fault_rate}")
    settings = Settings.from_env()
    spec = deployment_spec(ns, settings)
    model = spec.validate()  # refusals happen here, before Ray or any actor starts
    if ns.prompts:
        requests = workload.load_jsonl(
            ns.prompts, vocab_size=model.vocab_size, max_new_tokens=ns.max_new_tokens
        )
    else:
        requests = workload.generate(
            ns.requests,
            vocab_size=model.vocab_size,
            min_prompt=ns.min_prompt_len,
            max_prompt=ns.max_prompt_len,
            max_new_tokens=ns.max_new_tokens,
            seed=ns.seed,
        )
    if max(len(r.prompt) + r.max_new_tokens for r in requests) > spec.pool_args.context_len:
        raise ValueError(f"a request is longer than --context-len {spec.pool_args.context_len}; raise it")
    address = ns.address or settings.ray_address
    owns_ray = not ray.is_initialized()
    if owns_ray:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            cpus = ns.num_cpus or spec.num_prefill + spec.num_decode + 1
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    where = address or "an embedded local Ray cluster"
    print(f"distpool: {spec.num_prefill}P{spec.num_decode}D on {where}; {len(requests)} requests", flush=True)
    deployment = None
    try:
        deployment = Deployment.start(spec)
        started = time.monotonic()
        server = Server(deployment, ServeOptions(fault_rate=ns.fault_rate, seed=ns.seed))
        outcomes = asyncio.run(server.serve(requests))
        wall_s = time.monotonic() - started
        stats = ray.get([h.stats.remote() for h in deployment.handles().values()], timeout=60)
        parity = check_parity(spec, requests, outcomes, ns.parity_sample)
        report = summarize(outcomes, retried=server.retried, worker_stats=stats, parity=parity, wall_s=wall_s)
    finally:
        if deployment is not None:
            deployment.shutdown()
        if owns_ray:
            ray.shutdown()
    print(format_summary(report), flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=2)
    healthy = report["failed"] == 0 and report["parity_mismatches"] == 0
    healthy = healthy and report["leaked_pages"] == 0 and report["leaked_slots"] == 0
    return 0 if healthy else 1


if __name__ == "__main__":
    from distpool.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))
