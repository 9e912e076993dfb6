"""A reserved request's way into the decode batch (`Arrivals`), each step under the worker's lock:

    landed          every transfer of a waiting request concluded: failed, its reservation is freed;
                    else it has arrived, with the first token its header carried
    check           every byte of arrived envelopes checked; a mismatch fails its request as corrupt
                    (its bytes were damaged on their way: another attempt may land them intact)
    admit           verified requests join the batch (one whose first token ends it finishes at once)
    fail_elsewhere  past TP 1, a request whose shard passed here but failed on another rank

At TP 1 the decode loop checks and admits what arrived (`verify`); past it, every rank checks the
requests arrived on every rank and admits only those that passed on every rank (`decode.loop`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from decode.endings import Endings
from decode.request import DecodeRequest
from distpool.memory.pool import Pool
from distpool.model.sampling import finish_after
from distpool.model_impl.pool_model import Mismatch, PoolModel
from distpool.worker.metrics import WorkerMetrics
from transfer import FailureKind, Parts


class ArrivalWorker(Protocol):
    """What arrivals need of their decode worker (`decode.worker.DecodeWorker`)."""

    pool: Pool
    model: PoolModel
    metrics: WorkerMetrics
    wake: threading.Condition
    eos_token_ids: tuple[int, ...]
    waiting: dict[str, DecodeRequest]
    arrived: dict[str, DecodeRequest]
    running: dict[str, DecodeRequest]


class Arrivals:
    """The arrivals of `worker`, whose requests end through `endings`; `free(owned, request_id,
    pinned=...)` forgets an owned request and gives its memory back (`WorkerBase._free`). `verified`
    counts the envelopes checked byte for byte and admitted."""

    def __init__(self, worker: ArrivalWorker, endings: Endings, free: Callable[..., bool]) -> None:
        self.worker, self.endings, self._free = worker, endings, free
        self.verified = 0

    def landed(self, rid: str, req: DecodeRequest, parts: Parts) -> None:
        """Every transfer of waiting request `rid` concluded (a failure aborted the others first,
        so nothing still writes into it): it has arrived, or its reservation is freed."""
        worker = self.worker
        if parts.error is not None:
            worker.metrics.add_failure(parts.error.kind)
            self._free(worker.waiting, rid, pinned=True)
            return
        del worker.waiting[rid]
        worker.pool.unpin(rid)
        req.tokens.append(int(parts.transfers[0].first_token))
        req.received_bytes = parts.num_bytes
        req.landed_at = time.monotonic()
        worker.arrived[rid] = req
        worker.wake.notify_all()

    def verify(self) -> None:
        """Check every byte of each arrived envelope, then let those that passed join the batch."""
        self.admit(self.check(list(self.worker.arrived)))

    def check(self, rids: list[str]) -> list[str]:
        """Check every byte of the arrived envelopes `rids`; those that passed (they stay arrived
        until `admit`, or `fail_elsewhere`). A mismatch fails its request as corrupt (retried)."""
        worker, passed = self.worker, []
        for rid in rids:
            req = worker.arrived[rid]
            try:
                mismatch = worker.model.admit(worker.pool, rid, req.prompt, req.tokens[0])
            except ValueError as exc:  # e.g. a first token outside the vocabulary
                mismatch = exc
            if mismatch is None:
                passed.append(rid)
            else:
                found = mismatch if isinstance(mismatch, Mismatch) else None
                self.endings.fail_corrupt(
                    rid, worker.arrived.pop(rid), f"received {mismatch}", retry=True, mismatch=found
                )
        return passed

    def fail_elsewhere(self, rid: str) -> None:
        """An arrived request whose shard here passed failed its check on another rank of the group:
        it fails here too, as corrupt (retried), holding nothing."""
        req = self.worker.arrived.pop(rid)
        req.error, req.failure = "corrupt envelope: its shard on another rank", FailureKind.CORRUPT
        req.retry = True
        self.endings.give_back(rid, req)

    def admit(self, rids: list[str]) -> None:
        """Arrived requests `rids`, verified, join the batch (or finish)."""
        worker = self.worker
        for rid in rids:
            req = worker.arrived.pop(rid)
            self.verified += int(worker.model.verifies)
            req.verified = worker.model.verifies
            req.admitted_at = time.monotonic()
            req.finish = finish_after(req.params, worker.eos_token_ids, req.tokens)
            if req.finish is not None:  # its first token ended it: no decode step
                self.endings.finish(rid, req)
            else:
                worker.running[rid] = req
