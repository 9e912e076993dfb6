"""Bundled model configs: the reference models the main job and the tests run."""

from pathlib import Path

CONFIG_DIR = Path(__file__).parent
REFERENCE_HYBRID_CONFIG = CONFIG_DIR / "reference-hybrid.json"  # the main job's default model
REFERENCE_DENSE_CONFIG = CONFIG_DIR / "reference-dense.json"
REFERENCE_SWA_CONFIG = CONFIG_DIR / "reference-swa.json"
