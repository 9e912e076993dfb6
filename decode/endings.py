"""How a request held by the decode worker ends (`Endings`), each way under the worker's lock:

    finish      its last token is made: checked byte for byte, its full pages and final state kept
                where the prefix cache keeps them, the rest released
    fail_corrupt  its bytes are wrong (damaged on the way: retried; damaged here: not)
    give_back   given up after it arrived (failed here or on another rank of the group)
    give_up     cancelled, wherever it is held (prefilling, arrived, running or finished)
    fail_all    the decode loop failed: every request it holds fails with the reason

Whichever way, its memory goes back to the pool once and its result to the outbox once, where a
caller still waits for it (`decode.outbox.Outbox.hand_out`).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from typing import Protocol

from decode.outbox import Outbox
from decode.request import DecodeRequest
from distpool.memory.pool import Pool
from distpool.model_impl.pool_model import Mismatch, PoolModel
from distpool.worker.metrics import WorkerMetrics
from transfer import FailureKind


class EndingWorker(Protocol):
    """What the endings need of their decode worker (`decode.worker.DecodeWorker`)."""

    name: str
    pool: Pool
    model: PoolModel
    metrics: WorkerMetrics
    outbox: Outbox
    prefilling: dict[str, DecodeRequest]
    arrived: dict[str, DecodeRequest]
    running: dict[str, DecodeRequest]


class Endings:
    """The ways a request held by `worker` ends; `free(owned, request_id)` forgets an owned request
    and gives its memory back (`WorkerBase._free`). `corrupt` counts the envelopes found damaged."""

    def __init__(self, worker: EndingWorker, free: Callable[[dict, str], bool]) -> None:
        self.worker, self._free = worker, free
        self.corrupt = 0

    def finish(self, request_id: str, req: DecodeRequest) -> None:
        """It made its last token: check every byte once more (compaction or a neighbour's write could
        have damaged it), keep what the prefix cache keeps, release the rest, hand it out."""
        worker = self.worker
        pool = worker.pool
        mismatch = worker.model.check(pool, request_id)
        if mismatch is not None:
            # damaged here, in this pool: another attempt would find the same bytes
            self.fail_corrupt(request_id, req, f"at release {mismatch}", retry=False, mismatch=mismatch)
            return
        cache = pool.prefix_cache
        if cache is not None:  # its full pages stay for the next turn that shares them
            held = (req.prompt + req.tokens)[: pool.num_tokens(request_id)]  # the last token has no KV
            cache.cache_request(request_id, held)
            if cache.final_states is not None:  # and its state, for a next turn prefilled here
                cache.final_states.keep(request_id, held)
        worker.model.forget(request_id)
        req.finished_at = time.monotonic()
        pool.release(request_id)
        worker.outbox.hand_out(request_id, req)

    def fail_corrupt(
        self, rid: str, req: DecodeRequest, what: str, *, retry: bool, mismatch: Mismatch | None = None
    ) -> None:
        """The request's bytes are wrong; it is never decoded (further). `retry`: whether another
        attempt may succeed (bytes damaged on the way, not in this pool); `mismatch`: the first wrong
        byte, where the model found one."""
        self.corrupt += 1
        req.error, req.failure, req.retry = f"corrupt envelope: {what}", FailureKind.CORRUPT, retry
        req.mismatch = mismatch
        self.worker.metrics.add_failure(req.failure)
        print(f"distpool: {self.worker.name}: {rid}: {req.error}", file=sys.stderr, flush=True)
        self.give_back(rid, req)

    def give_back(self, rid: str, req: DecodeRequest) -> None:
        """A request given up after it arrived frees its memory; its failure is handed out."""
        worker = self.worker
        worker.model.forget(rid)
        worker.pool.release(rid)
        req.finished_at = time.monotonic()
        worker.outbox.hand_out(rid, req)

    def give_up(self, request_id: str, *, notify: bool) -> bool:
        """Drop a prefilling, arrived, running or finished request (`DecodeWorker.cancel`); whether
        there was one. With `notify` it is handed out as failed, so that a driver waiting hears."""
        worker = self.worker
        held = (worker.prefilling, worker.arrived, worker.running, worker.outbox.finished)
        req = next((owned[request_id] for owned in held if request_id in owned), None)
        if req is None:
            return False
        for owned in (worker.prefilling, worker.arrived, worker.running):
            self._free(owned, request_id)
        worker.outbox.finished.pop(request_id, None)
        if notify:
            req.error, req.failure = "decode gave the request up (receiver cancel)", FailureKind.ABORTED
            worker.outbox.hand_out(request_id, req)
        return True

    def fail_all(self, exc: Exception) -> None:
        """The decode loop raised: every request it holds (prefilling, arrived or running) fails with
        the reason, is handed out, and gives its memory back."""
        worker = self.worker
        reason = f"the decode loop failed: {type(exc).__name__}: {exc}"
        print(f"distpool: {worker.name}: {reason}", file=sys.stderr, flush=True)
        traceback.print_exc()
        worker.metrics.add_failure(FailureKind.INTERNAL)
        for owned in (worker.prefilling, worker.arrived, worker.running):
            for rid, req in list(owned.items()):
                try:
                    self._free(owned, rid)
                except Exception:  # its memory stays behind: the run's leak check reports it
                    owned.pop(rid, None)
                req.error, req.failure, req.retry = reason, FailureKind.INTERNAL, False
                req.finished_at = time.monotonic()
                worker.outbox.hand_out(rid, req)
