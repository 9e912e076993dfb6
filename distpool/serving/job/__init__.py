"""One `distpool run`: checked before Ray starts, served, and written out.

`main.py`: the main job; `preflight.py`: the budget against this machine, the cluster answering;
`run_memory.py`: the memory a run takes, counted before it starts; `output.py`: the `--json` and
`--outputs` files, checked first and written whole.
"""

from distpool.serving.job.main import drop_prefix_caches, run, start_ray, worker_stats
from distpool.serving.job.output import check_distinct_outputs, check_output_path
from distpool.serving.job.preflight import check_cluster, check_fits_this_machine, default_budget_bytes

__all__ = [
    "check_cluster",
    "check_distinct_outputs",
    "check_fits_this_machine",
    "check_output_path",
    "default_budget_bytes",
    "drop_prefix_caches",
    "run",
    "start_ray",
    "worker_stats",
]
