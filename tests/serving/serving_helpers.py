"""Small factories shared by the serving tests."""

import asyncio

from distpool import workload
from distpool.workload import Request


def mixed_requests(n: int, *, max_new_tokens: int, seed: int = 0, max_prompt: int = 40) -> list[Request]:
    return workload.generate(
        n, vocab_size=96, min_prompt=1, max_prompt=max_prompt, max_new_tokens=max_new_tokens, seed=seed
    )


def serve(spec, requests, **options):
    """Start a deployment, serve `requests`, return (outcomes, worker stats, server); always shuts down."""
    import ray

    from distpool.launcher import Deployment
    from distpool.serve import ServeOptions, Server

    deployment = Deployment.start(spec)
    try:
        server = Server(deployment, ServeOptions(progress=False, **options))
        outcomes = asyncio.run(server.serve(requests))
        stats = ray.get([h.stats.remote() for h in deployment.handles().values()], timeout=60)
    finally:
        deployment.shutdown()
    return outcomes, stats, server
