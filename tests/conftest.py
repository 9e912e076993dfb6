"""One local Ray cluster for the whole serving test session; tests shut down only what they start."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if ray.is_initialized():
        yield ray
        return
    # Logical CPUs: workers are mostly idle between steps, so more actors than cores is fine.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
