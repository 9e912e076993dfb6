"""Serving: the deployment on Ray, routing, the PD driver, workloads, parity, the report, the run.

Bottom to top (the import contract in pyproject.toml enforces the order):
- `outcome.py`: what became of a request; `metrics.py`: the driver's metrics and the embedded
  cluster's exporter; `interrupt.py`: SIGTERM taken as Ctrl-C (the last two read by the CLI without
  importing the engine);
- `workloads/`: the requests a run serves; `routing/`: which workers a request goes to;
- `deploy/`: the deployment on Ray, a TP group's handle, lost and restarted workers;
- `path/`: the driver and each attempt at a request; `summary/`: parity and the report;
- `job/`: one `distpool run`, checked before Ray starts, served and written out.
Each subpackage's `__init__` names what the others may use.
"""
