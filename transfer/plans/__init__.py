"""Which bytes move: pure plans from both ends' rows to coalesced runs, chunks and messages.

`plan.py`: one rank to one rank (coalesced runs); `messages.py`: runs into chunks, messages and
streams; `reshard.py`: between two TP layouts, which source rank sends which bytes to which
destination rank, with `unit_templates.py` (inside one unit, which source rank sends which pieces);
`tp_pair.py`: what one channel moves across TP sizes; `tp_handshake.py`: the hello fields two TP
layouts must share, and whether they reshard; `errors.py`: what a plan refuses, as facts.
"""

from transfer.plans.errors import (
    BAD_SHAPE,
    DIFFERENT_MODELS,
    EMPTY,
    NEGATIVE,
    OVERLAPPING,
    PAST_ARENA,
    RANKS_NOT_IN_ORDER,
    TABLES_PER_RANK,
    UNIT_COUNTS_DIFFER,
    LayoutsDoNotPair,
    RangesRefused,
    RowsDoNotPair,
    UnitSizesDiffer,
)
from transfer.plans.messages import Chunk, Message, MessagePlan, plan_messages
from transfer.plans.plan import DST, NBYTES, SRC, check_ranges, moving_rows, plan_runs
from transfer.plans.reshard import source_ranks
from transfer.plans.tp_handshake import check_reshard, tp_differing_fields, tp_of
from transfer.plans.tp_pair import TpPair, channel_runs

__all__ = [
    "BAD_SHAPE",
    "Chunk",
    "DIFFERENT_MODELS",
    "DST",
    "EMPTY",
    "LayoutsDoNotPair",
    "Message",
    "MessagePlan",
    "NBYTES",
    "NEGATIVE",
    "OVERLAPPING",
    "PAST_ARENA",
    "RANKS_NOT_IN_ORDER",
    "RangesRefused",
    "RowsDoNotPair",
    "SRC",
    "TABLES_PER_RANK",
    "TpPair",
    "UNIT_COUNTS_DIFFER",
    "UnitSizesDiffer",
    "channel_runs",
    "check_ranges",
    "check_reshard",
    "moving_rows",
    "plan_messages",
    "plan_runs",
    "source_ranks",
    "tp_differing_fields",
    "tp_of",
]
