"""Checks `distpool run` makes before Ray starts: the budget fits this machine, the cluster answers."""

from __future__ import annotations

import dataclasses
import socket

from distpool.memory.sizing import GIB, PoolArgs, size_pools
from distpool.model.spec import ModelSpec
from distpool.serving.job.run_memory import PROCESS_BYTES, RunMemory
from distpool.worker.config import DEFAULT_BUDGET_BYTES, WorkerConfig

DEFAULT_FULL_CONTEXT_REQUESTS = 4  # what a default synthetic-cache pool holds at --context-len
DEFAULT_SHARE_OF_MEMORY = 0.4  # of this machine's available memory, over all workers
HOST_SHARE_OF_MEMORY = 0.9  # a run may take this much of the available memory, everything counted


def default_budget_bytes(spec: ModelSpec, pool_args: PoolArgs, model_impl: str, num_workers: int) -> int:
    """`--memory-gib` when none is given: 256 MiB for the reference model; for the synthetic cache
    and the transformers runner (a real model's sizes), room for 4 requests at full context, in
    256 MiB steps, but at most 40% of this machine's available memory split over the workers (and
    never under 256 MiB)."""
    if model_impl == "reference":
        return DEFAULT_BUDGET_BYTES
    args = dataclasses.replace(pool_args, disaggregation_mode="decode")
    one = size_pools(spec, args, 1 << 50).request_bytes_at_full_context
    step = DEFAULT_BUDGET_BYTES
    wanted = -(-DEFAULT_FULL_CONTEXT_REQUESTS * one // step) * step
    available = _available_host_bytes()
    if available is not None:
        wanted = min(wanted, int(DEFAULT_SHARE_OF_MEMORY * available / num_workers) // step * step)
    return max(wanted, step)


def check_fits_this_machine(worker: WorkerConfig, num_prefill: int, num_decode: int) -> None:
    """Refuse a run this machine cannot hold (`check` plans for any budget; `run` allocates): with
    CUDA, each worker's pool, staging and link measurement on its GPU; on the CPU, everything the
    run's processes take (`RunMemory`: workers, driver and the embedded cluster) within
    HOST_SHARE_OF_MEMORY of the memory available now."""
    device = worker.device
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {device}: no CUDA device is visible here. Fix: --device cpu (or auto)"
            )
        index = int(device.partition(":")[2] or torch.cuda.current_device())
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"numbered from 0. Fix: --device cuda (a GPU per worker) or cuda:0"
            )
        free_bytes, _ = torch.cuda.mem_get_info(index)
        memory = RunMemory.of(worker, num_prefill, num_decode)
        on_gpu = max(memory.prefill_bytes, memory.decode_bytes) - PROCESS_BYTES  # the process is on the host
        if on_gpu > free_bytes:
            raise ValueError(
                f"--memory-gib {worker.budget_bytes / GIB:g} per worker needs {on_gpu / GIB:.1f} GiB of a "
                f"GPU with its staging and link measurement, beyond the GPU's free {free_bytes / GIB:.1f} "
                "GiB. Fix: lower --memory-gib"
            )
        return
    available = _available_host_bytes()
    memory = RunMemory.of(worker, num_prefill, num_decode)
    if available is not None and memory.total_bytes > HOST_SHARE_OF_MEMORY * available:
        raise ValueError(
            f"--memory-gib {worker.budget_bytes / GIB:g} for each of {num_prefill + num_decode} workers "
            f"takes {memory.describe()}; this machine has {available / GIB:.1f} GiB available. Fix: lower "
            "--memory-gib or run fewer workers"
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


def check_cluster(
    address: str | None, address_from: str, *, num_cpus: int | None, spread: bool, num_workers: int
) -> None:
    """The cluster flags agree with each other and with where the run goes: the embedded cluster
    (no address) is one node with `--num-cpus` CPUs, one per worker at least; an attached cluster
    (`address`, given by `address_from`: "--address" or "RAY_ADDRESS") brings its own CPUs and must
    answer. Raises ValueError naming the flag."""
    if address is None:
        if spread:
            raise ValueError(
                f"--spread puts each of the {num_workers} workers on its own node, but the embedded "
                "cluster is this one node. Fix: drop --spread, or attach to a cluster with --address"
            )
        if num_cpus is not None and num_cpus < num_workers:
            raise ValueError(
                f"--num-cpus {num_cpus}: each of the {num_workers} workers takes one CPU of the embedded "
                f"cluster, so fewer never start. Fix: --num-cpus {num_workers} or more, or drop it"
            )
        return
    if num_cpus is not None:
        raise ValueError(
            f"--num-cpus sizes the embedded cluster, but {address_from} attaches to a cluster that "
            "brings its own CPUs. Fix: drop --num-cpus"
        )
    check_reachable(address, address_from)


def check_reachable(address: str, address_from: str = "--address") -> None:
    """`auto`, `local`, or a `[ray://]host:port` that answers within a few seconds (Ray itself
    retries for minutes, and hangs on a port it cannot parse)."""
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{address_from} {address}: not an address Ray can attach to. Fix: HOST:PORT (port 1 to "
            "65535), ray://HOST:PORT, or auto"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()  # [::1]: IPv6
    except OSError as exc:
        raise ValueError(
            f"{address_from} {address}: no Ray cluster answers there ({exc.strerror or exc}). Fix: start "
            "one (`ray start --head`) or unset it to run on an embedded local cluster"
        ) from None
