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


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict:
    """A tiny seeded checkpoint folder per architecture the transformers runner serves (float32)."""
    from tests.hf_checkpoints import ARCHITECTURES, save_checkpoint

    root = tmp_path_factory.mktemp("hf_checkpoints")
    return {name: save_checkpoint(name, root / name) for name in ARCHITECTURES}
