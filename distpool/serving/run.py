"""The main job: serve a workload through PD on Ray, check parity, print and write the summary.

With no address it starts an embedded local Ray; inside a Ray job (RAY_ADDRESS is set by
`ray job submit`) or with an address it attaches to that cluster. `distpool.cli` parses the
command line and validates everything before calling `run`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import ray

from distpool.serving.deployment import Deployment, DeploymentSpec
from distpool.serving.driver import ServeOptions, Server
from distpool.serving.parity import check_parity
from distpool.serving.report import format_summary, summarize
from distpool.serving.workload import Request


def run(
    spec: DeploymentSpec,
    requests: list[Request],
    *,
    address: str | None,
    num_cpus: int | None = None,
    fault_rate: float = 0.0,
    seed: int = 0,
    parity_sample: int = 4,
    json_path: str | None = None,
) -> int:
    """Serve `requests`; returns the exit status (0 only when every request completed, parity held
    and nothing leaked)."""
    owns_ray = not ray.is_initialized()
    if owns_ray:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            cpus = num_cpus or spec.num_prefill + spec.num_decode + 1
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    where = address or "an embedded local Ray cluster"
    print(f"distpool: {spec.num_prefill}P{spec.num_decode}D on {where}; {len(requests)} requests", flush=True)
    deployment = None
    try:
        deployment = Deployment.start(spec)
        started = time.monotonic()
        server = Server(deployment, ServeOptions(fault_rate=fault_rate, seed=seed))
        outcomes = asyncio.run(server.serve(requests))
        wall_s = time.monotonic() - started
        stats = ray.get([h.stats.remote() for h in deployment.handles().values()], timeout=60)
        parity = check_parity(spec, requests, outcomes, parity_sample)
        report = summarize(outcomes, retried=server.retried, worker_stats=stats, parity=parity, wall_s=wall_s)
    finally:
        if deployment is not None:
            deployment.shutdown()
        if owns_ray:
            ray.shutdown()
    print(format_summary(report), flush=True)
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    healthy = report["failed"] == 0 and report["parity_mismatches"] == 0
    healthy = healthy and report["leaked_pages"] == 0 and report["leaked_slots"] == 0
    return 0 if healthy else 1
