"""Prometheus metrics a worker records through Ray's metrics API (`ray.util.metrics`).

Ray's metrics agent on each node exports them with a `ray_` prefix: `distpool_pages_used` is scraped
as `ray_distpool_pages_used`. Recording is best effort: it never raises into the worker (a failure is
logged once), and it is a no-op where Ray is not running in the process, which is how unit tests build
workers. Whether Ray runs is decided once, when the metrics are built: build them in the process that
records them (inside the actor), after `ray.init`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from transfer.wire import FailureKind

logger = logging.getLogger(__name__)

TAG_KEYS = ("worker", "role")


def ray_is_running() -> bool:
    """Whether this process is a connected Ray driver or worker. Outside one, `ray.util.metrics` does
    not fail: it keeps the values in this process where nothing exports them. Ray that was never
    imported was never initialized, so the no-Ray path does not pay for importing it."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


class LoggedOnce:
    """Swallows whatever recording raises and logs the first failure of its owner (`what`)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures = 0

    @contextmanager
    def guard(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:  # a metric must never fail the request it describes
            self.failures += 1
            if self.failures == 1:
                logger.warning(
                    "%s: recording a metric failed, later failures are not logged: %r", self.what, exc
                )


def increment(counter: Any, value: float, tags: dict[str, str] | None = None) -> None:
    """Ray's counters refuse a zero increment (and a negative one: that still raises, to be logged)."""
    if value != 0:
        counter.inc(float(value), tags)


@dataclass(frozen=True)
class _WorkerInstruments:
    pages_used: Any  # ray.util.metrics.Gauge
    pages_capacity: Any
    slots_used: Any
    slots_capacity: Any
    compactions: Any  # ray.util.metrics.Counter
    compaction_bytes: Any
    transfer_bytes: Any
    transfer_seconds: Any
    transfer_failures: Any  # tagged also by `reason`

    @classmethod
    def build(cls, tags: dict[str, str]) -> _WorkerInstruments:
        from ray.util.metrics import Counter, Gauge

        def gauge(name: str, description: str) -> Gauge:
            return Gauge(name, description, TAG_KEYS).set_default_tags(tags)

        def counter(name: str, description: str, extra_keys: tuple[str, ...] = ()) -> Counter:
            return Counter(name, description, TAG_KEYS + extra_keys).set_default_tags(tags)

        return cls(
            pages_used=gauge("distpool_pages_used", "Pool pages held by requests."),
            pages_capacity=gauge("distpool_pages_capacity", "Pool pages in all."),
            slots_used=gauge("distpool_slots_used", "State slots held by requests."),
            slots_capacity=gauge("distpool_slots_capacity", "State slots in all."),
            compactions=counter("distpool_compactions_total", "Pool compactions run."),
            compaction_bytes=counter("distpool_compaction_bytes_total", "Bytes moved by compactions."),
            transfer_bytes=counter("distpool_transfer_bytes_total", "Envelope bytes transferred."),
            transfer_seconds=counter("distpool_transfer_seconds_total", "Wall seconds spent transferring."),
            transfer_failures=counter(
                "distpool_transfer_failures_total", "Failed transfers, by failure kind.", ("reason",)
            ),
        )


class WorkerMetrics:
    """The metrics one worker records, tagged {"worker": worker_name, "role": role}.

    Counters take increments (what happened since the last call), gauges take the current value.
    """

    def __init__(self, worker_name: str, role: str) -> None:
        self.tags = {"worker": str(worker_name), "role": str(role)}
        self._errors = LoggedOnce(f"metrics of worker {worker_name}")
        self._instruments: _WorkerInstruments | None = None
        if ray_is_running():
            with self._errors.guard():
                self._instruments = _WorkerInstruments.build(self.tags)

    @property
    def enabled(self) -> bool:
        """Whether records reach Ray's exporter (False: every method is a no-op)."""
        return self._instruments is not None

    def set_usage(self, pages_used: int, pages_capacity: int, slots_used: int, slots_capacity: int) -> None:
        """The pool's held and total pages and slots, as of now."""
        if (m := self._instruments) is None:
            return
        with self._errors.guard():
            m.pages_used.set(float(pages_used))
            m.pages_capacity.set(float(pages_capacity))
            m.slots_used.set(float(slots_used))
            m.slots_capacity.set(float(slots_capacity))

    def add_compactions(self, count: int, nbytes: int) -> None:
        """`count` compactions that moved `nbytes` in all, since the last call."""
        if (m := self._instruments) is None:
            return
        with self._errors.guard():
            increment(m.compactions, count)
            increment(m.compaction_bytes, nbytes)

    def add_transfer(self, nbytes: int, seconds: float) -> None:
        """One transfer that completed: its envelope bytes and wall seconds."""
        if (m := self._instruments) is None:
            return
        with self._errors.guard():
            increment(m.transfer_bytes, nbytes)
            increment(m.transfer_seconds, seconds)

    def add_failure(self, kind: FailureKind) -> None:
        """One transfer (or received envelope) that failed as `kind`, its `reason` tag."""
        if (m := self._instruments) is None:
            return
        with self._errors.guard():
            m.transfer_failures.inc(1.0, {"reason": FailureKind(kind).value})
