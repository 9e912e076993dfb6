"""Checks `distpool run` makes before Ray starts: the budget fits this machine, the cluster answers."""

from __future__ import annotations

import dataclasses
import socket

from distpool.memory.sizing import GIB, PoolArgs, size_pools
from distpool.model.spec import ModelSpec
from distpool.worker.config import DEFAULT_BUDGET_BYTES, WorkerConfig

DEFAULT_FULL_CONTEXT_REQUESTS = 4  # what a default synthetic-cache pool holds at --context-len
DEFAULT_SHARE_OF_MEMORY = 0.4  # of this machine's available memory, over all workers


def default_budget_bytes(spec: ModelSpec, pool_args: PoolArgs, cache: str, num_workers: int) -> int:
    """`--memory-gib` when none is given: 256 MiB for the reference model; for the synthetic cache
    (a real model's sizes), room for 4 requests at full context, in 256 MiB steps, but at most 40% of
    this machine's available memory split over the workers (and never under 256 MiB)."""
    if cache != "synthetic":
        return DEFAULT_BUDGET_BYTES
    args = dataclasses.replace(pool_args, disaggregation_mode="decode")
    one = size_pools(spec, args, 1 << 50).request_bytes_at_full_context
    step = DEFAULT_BUDGET_BYTES
    wanted = -(-DEFAULT_FULL_CONTEXT_REQUESTS * one // step) * step
    available = _available_host_bytes()
    if available is not None:
        wanted = min(wanted, int(DEFAULT_SHARE_OF_MEMORY * available / num_workers) // step * step)
    return max(wanted, step)


def check_fits_this_machine(worker: WorkerConfig, num_workers: int) -> None:
    """Refuse budgets this machine cannot hold (`check` plans for any budget; `run` allocates)."""
    device = worker.device
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {device}: no CUDA device is visible here. Fix: --device cpu (or auto)"
            )
        free_bytes, _ = torch.cuda.mem_get_info()
        if worker.budget_bytes > free_bytes:
            raise ValueError(
                f"--memory-gib {worker.budget_bytes / GIB:g} per worker exceeds the GPU's free "
                f"{free_bytes / GIB:.1f} GiB. Fix: lower --memory-gib"
            )
        return
    available = _available_host_bytes()
    needed = worker.budget_bytes * num_workers
    if available is not None and needed > 0.8 * available:  # the rest: Ray, torch and the driver
        raise ValueError(
            f"--memory-gib {worker.budget_bytes / GIB:g} for each of {num_workers} workers needs "
            f"{needed / GIB:.1f} GiB, but this machine has {available / GIB:.1f} GiB available. "
            "Fix: lower --memory-gib or run fewer workers"
        )


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_reachable(address: str) -> None:
    """A `host:port` address must answer within a few seconds (Ray itself retries for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", "local" and the like: Ray resolves them
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as exc:
        raise ValueError(
            f"--address {address}: no Ray cluster answers there ({exc.strerror or exc}). Fix: start one "
            "(`ray start --head`) or drop --address to run on an embedded local cluster"
        ) from None
