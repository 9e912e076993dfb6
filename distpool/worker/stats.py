"""What a worker reports of itself: its pool's occupancy and its counters, one typed value each.

`WorkerBase.stats()` returns a `PrefillStats` or a `DecodeStats` (a `WorkerStats` with the role's
own counters); `drop_prefix_cache()` returns `PoolHeld`. The driver reads them by attribute (and
writes them into the run's JSON with `dataclasses.asdict`); Ray pickles them as they are. A band's
`*_used` counts what requests hold: cached pages and checkpoints are counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolHeld:
    """Pages and slots a pool holds (by requests and by its prefix cache) at one moment."""

    pages_used: int
    slots_used: int


@dataclass(frozen=True)
class WorkerStats:
    """What every worker reports; read with its lock held, the pool's invariants checked."""

    name: str
    role: str  # "prefill" | "decode"
    node_id: str | None  # the Ray node it runs on (None outside Ray)
    rejected_control_messages: int  # did not open under the deployment's secret, all channels
    pages_used: int  # held by requests now
    pages_peak: int
    pages_capacity: int
    slots_used: int
    slots_peak: int
    slots_capacity: int
    cached_pages: int  # kept by the prefix cache, held by no request
    checkpoints: int  # state checkpoints kept by the prefix cache
    evicted_pages: int  # reclaimed from the prefix cache so far
    evicted_checkpoints: int


@dataclass(frozen=True)
class PrefillStats(WorkerStats):
    held: int  # requests whose source envelope lives here now (reserved until their transfer ends)


@dataclass(frozen=True)
class DecodeStats(WorkerStats):
    waiting: int  # reserved, their transfer not concluded
    prefilling: int  # prefilled here from a kept final state, their prompt not wholly computed yet
    local_prefills: int  # accepted for local prefill so far (this life of the worker only)
    decode_state_checkpoints: int  # finished requests' final states kept so far
    arrived: int  # landed, not yet verified
    running: int  # in the decode batch
    verified_envelopes: int  # every byte checked (this life of the worker only)
    corrupt_envelopes: int
    finished_uncollected: int  # finished, not yet handed out by `next_finished`
    steps: int  # decode steps run
