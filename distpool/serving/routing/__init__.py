"""Which workers a request goes to: pure bookkeeping over worker names, no Ray.

`router.py`: the decode worker caching the longest prefix first (its views of decode's caches), then
the least loaded; `conditional.py`: whether a request is prefilled on the decode worker holding its
state (the cost model, over the router's views).
"""

from distpool.serving.routing.conditional import ConditionalOptions, LocalPrefillPolicy, Sizes
from distpool.serving.routing.router import NoWorkerAlive, Router

__all__ = [
    "ConditionalOptions",
    "LocalPrefillPolicy",
    "NoWorkerAlive",
    "Router",
    "Sizes",
]
