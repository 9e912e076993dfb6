"""Checks `distpool run` makes before Ray starts: the budget fits this machine, the cluster answers."""

from __future__ import annotations

import socket

from distpool.memory.sizing import GIB
from distpool.worker.config import WorkerConfig


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
