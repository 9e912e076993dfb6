"""The allocator: which request holds which ids, how requests grow, and how the bands compact.

`allocator.py` composes the parts: the table of live requests (`requests.py`, with its batch
checks), where a batch's units go (`placement.py`), the growth room a request expects (`claims.py`),
what a request of n tokens holds (`footprint.py`), growth of live requests (`growth.py`), pages with
several holders (`sharing.py`), and the compaction planner (`compaction.py`, which chooses between
moving the requests in the way, `evacuate.py`, and sliding a stretch, `slide.py`, by the cost model
in `move_cost.py`).
"""

from distpool.memory.alloc.allocator import Allocator
from distpool.memory.alloc.move_cost import RUN_BYTES
from distpool.memory.alloc.sharing import SharedPages

__all__ = ["Allocator", "RUN_BYTES", "SharedPages"]
