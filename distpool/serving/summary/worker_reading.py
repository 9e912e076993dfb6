"""What the driver read of one worker at the end of a run (`WorkerReading`): its stats, or why none."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from distpool.worker.stats import PoolHeld, WorkerStats

ALIVE = "alive"
# The figures a worker that could not be read lists as unknown (None), not zero.
UNKNOWN_FIGURES = tuple(
    f"{band}_{what}" for band in ("pages", "slots") for what in ("used", "peak", "capacity")
)


@dataclass(frozen=True)
class WorkerReading:
    """One worker as the driver found it: `state` is "alive" (its `stats` read), "dead" or "not
    answering" (no stats: its figures are unknown); `error` says what a call to it raised."""

    name: str
    state: str = ALIVE
    stats: WorkerStats | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if (self.stats is not None) != (self.state == ALIVE):
            raise ValueError(
                f"{self.name}: a reading has stats exactly when it is {ALIVE}; it is {self.state}"
            )

    def after_drop(self, held: PoolHeld) -> WorkerReading:
        """With what its pool still holds once its prefix cache was dropped (`drop_prefix_cache`):
        each band's `*_used` is the larger of before and after."""
        if self.stats is None:
            raise ValueError(f"{self.name} is {self.state}: it has no stats to update")
        stats = replace(
            self.stats,
            pages_used=max(self.stats.pages_used, held.pages_used),
            slots_used=max(self.stats.slots_used, held.slots_used),
        )
        return replace(self, stats=stats)

    def failed(self, error: str) -> WorkerReading:
        """The same reading, with a later call's failure noted."""
        return replace(self, error=error)

    def to_json(self) -> dict:
        """One entry of the summary's `workers`: the stats' fields, `name`, `state` and `error` (if
        any); a worker not read lists `UNKNOWN_FIGURES` as None."""
        figures = asdict(self.stats) if self.stats is not None else dict.fromkeys(UNKNOWN_FIGURES)
        return {**figures, "name": self.name, "state": self.state} | (
            {"error": self.error} if self.error else {}
        )
