"""What a run reports: parity against an oracle, the summary and its printed table.

`parity.py`: a sample of outputs against the implementation's oracle; `report.py`: the summary
`--json` writes; `report_text.py`: the table printed; `worker_reading.py`: what was read of each
worker at the end.
"""

from distpool.serving.summary.parity import Parity, check_parity, parity_pool_sizes
from distpool.serving.summary.report import TTFT_PARTS, leak_counts, link_summary, percentile, summarize
from distpool.serving.summary.report_text import format_summary
from distpool.serving.summary.worker_reading import WorkerReading

__all__ = [
    "Parity",
    "TTFT_PARTS",
    "WorkerReading",
    "check_parity",
    "format_summary",
    "leak_counts",
    "link_summary",
    "parity_pool_sizes",
    "percentile",
    "summarize",
]
