"""Small factories shared by the serving tests."""

import asyncio

from distpool.memory.sizing import PoolArgs
from distpool.model.hf_config import spec_from_hf
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.serving.deploy.deployment import DeploymentSpec
from distpool.serving.workloads import workload
from distpool.serving.workloads.workload import Request
from distpool.worker.config import WorkerConfig
from transfer import TransferOptions


def mixed_requests(n: int, *, max_new_tokens: int, seed: int = 0, max_prompt: int = 40) -> list[Request]:
    return workload.generate(
        n, vocab_size=96, min_prompt=1, max_prompt=max_prompt, max_new_tokens=max_new_tokens, seed=seed
    )


def make_spec(
    *,
    device: str = "cpu",
    unified: bool | None = None,
    transfer_timeout_s: float = 5.0,
    budget_bytes: int = 8 << 20,
    **counts: int,
) -> DeploymentSpec:
    """The reference model on 8 MiB pools (`budget_bytes`) of 4-token pages (`counts`: num_prefill,
    num_decode)."""
    worker = WorkerConfig(
        spec=spec_from_hf(REFERENCE_HYBRID_CONFIG),
        pool_args=PoolArgs(page_size=4, context_len=256),
        budget_bytes=budget_bytes,
        transfer=TransferOptions(timeout_s=transfer_timeout_s),
        device=device,
    )
    return DeploymentSpec.build(worker, unified=unified, **counts)


def serve(spec, requests, **options):
    """Start a deployment, serve `requests`, return (outcomes, worker stats, server); always shuts down."""
    import ray

    from distpool.serving.deploy.deployment import Deployment
    from distpool.serving.path.driver import ServeOptions, Server

    deployment = Deployment.start(spec)
    try:
        server = Server(deployment, ServeOptions(progress=False, **options))
        outcomes = asyncio.run(server.serve(requests))
        stats = ray.get([h.stats.remote() for h in deployment.handles().values()], timeout=60)
    finally:
        deployment.shutdown()
    return outcomes, stats, server


def tp_worker(
    spec,
    prefill_tp: int,
    decode_tp: int,
    *,
    page_size: int = 4,
    context_len: int = 128,
    budget_bytes: int = 4 << 20,
    transfer_timeout_s: float = 10.0,
    **changes,
) -> WorkerConfig:
    """A synthetic-cache worker of `spec` at TP `prefill_tp` -> `decode_tp` (`budget_bytes` per rank)."""
    return WorkerConfig(
        spec=spec,
        pool_args=PoolArgs(page_size=page_size, context_len=context_len, prefix_cache=True),
        budget_bytes=budget_bytes,
        transfer=TransferOptions(timeout_s=transfer_timeout_s),
        model_impl="synthetic",
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        **changes,
    )
