"""Bundled model configs: the reference models the main job and the tests run; the serving benchmark's."""

from pathlib import Path

CONFIG_DIR = Path(__file__).parent
REFERENCE_HYBRID_CONFIG = CONFIG_DIR / "reference-hybrid.json"  # the main job's default model
REFERENCE_DENSE_CONFIG = CONFIG_DIR / "reference-dense.json"
REFERENCE_SWA_CONFIG = CONFIG_DIR / "reference-swa.json"
# The serving benchmark's model: Bamba-style, served by the transformers runner with seeded random
# weights (`--model-impl transformers --load-format dummy`), large enough that a prefill costs tens
# of decode steps on a CPU (scripts/bench_serve_model.py measures it).
BENCH_BAMBA_CONFIG = CONFIG_DIR / "bench-bamba.json"
