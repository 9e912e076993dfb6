"""The decode worker's loop (`DecodeLoop`): one thread that decides, under the worker's lock, what
happens next: verify what arrived, advance a local prefill and step the batch, or wait for work.

At TP 1 the loop serves on its own:

    arrived envelopes    verified once the channels are idle (verification and a landing transfer
                         share a CPU's cores), or after MAX_VERIFY_PUT_OFF_S whatever they do
    running / prefilling one local-prefill chunk, then one decode step of the batch
    nothing              wait for an arrival (or shutdown)

Past TP 1 the group's ranks step together (`distpool.worker.lockstep`): a round starts once every
rank has entered it. Rank 0 with nothing enters once work of its own arrives (at most LOCKSTEP_IDLE_S
later, so that the others' waits in the round stay short). A rank whose last round stepped nothing
because another rank holds a request whose shard has not landed here yet, or because a request runs
here that the others gave up, enters once it lands or is given up here too (either wakes it; at most
LOCKSTEP_IDLE_S later: a shard may never land); the others wait for it in the round. In each round
every rank verifies the requests that arrived on every rank, and those whose shard passed on every
rank join the batch (one that failed on any rank fails as corrupt on every rank, so that every rank
hands out its result), then every rank steps the requests running on every rank, in rank 0's order.
Any failure there is the group's: the rank's requests fail and it goes down.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from decode.arrivals import Arrivals
from decode.local_prefill import LocalPrefills
from decode.request import DecodeRequest
from distpool.worker.lockstep import Lockstep
from transfer.peers import PeerChannels

# A landed envelope's verification waits for the transfers moving bytes now (on a CPU they share the
# cores), for at most this long: a steady stream of transfers does not starve it.
MAX_VERIFY_PUT_OFF_S = 0.5
# Past TP 1, rank 0 with nothing running, or a rank waiting for a shard to land, enters a round at
# least this often (the other ranks wait in it meanwhile).
LOCKSTEP_IDLE_S = 0.05


class LoopWorker(Protocol):
    """What the loop needs of its decode worker (`decode.worker.DecodeWorker`): its state, guarded by
    `lock` (`wake` is notified when it changes), and the steps the loop takes under that lock."""

    lock: threading.RLock
    wake: threading.Condition
    lockstep: Lockstep | None
    rank: int
    channels: PeerChannels
    local: LocalPrefills
    arrived: dict[str, DecodeRequest]
    running: dict[str, DecodeRequest]
    prefilling: dict[str, DecodeRequest]
    arrivals: Arrivals  # verifies what arrived and admits it (`decode.arrivals`)

    def step_locked(self, rids: list[str] | None = None) -> None: ...
    def fail_loop_requests(self, exc: Exception) -> None: ...
    def group_broken(self, exc: BaseException) -> None: ...


class DecodeLoop:
    """The loop of `worker` (started by `start`, ended by `stop`)."""

    def __init__(self, worker: LoopWorker) -> None:
        self.worker = worker
        self.stopping = False  # guarded by the worker's lock
        self._verify_by: float | None = None  # arrived envelopes are verified by then, transfers or not
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the loop (after the step it is in) and wait for it, at most 5 s."""
        with self.worker.lock:
            self.stopping = True
            self.worker.wake.notify_all()
        self._thread.join(timeout=5)

    def failed(self) -> None:
        """Under the lock: the loop's requests were failed; verification starts afresh."""
        self._verify_by = None

    def _run(self) -> None:
        if self.worker.lockstep is not None:
            self._run_in_lockstep()
            return
        worker = self.worker
        while True:
            put_off_s = 0.0
            with worker.lock:
                if self.stopping:
                    return
                try:
                    put_off_s = self._once()
                except Exception as exc:  # a bug: the loop's requests fail, and it goes on serving
                    worker.fail_loop_requests(exc)
            if put_off_s > 0:  # outside the lock: receives and reservations go on meanwhile
                worker.channels.activity.wait_idle(put_off_s)
            else:
                time.sleep(0)  # between steps: let receives and reservations take the lock

    def _once(self) -> float:
        """Under the lock: verify what arrived, else one decode step, else wait for work. Returns how
        long to wait for the channels to go idle first (0: go on)."""
        worker = self.worker
        if worker.arrived:
            now = time.monotonic()
            if self._verify_by is None:
                self._verify_by = now + MAX_VERIFY_PUT_OFF_S
            if worker.channels.moving() and now < self._verify_by:
                # Verification shares the cores with the transfer landing now: let it land first (on
                # a GPU they would not compete). Decode steps wait too.
                return self._verify_by - now
            self._verify_by = None
            worker.arrivals.verify()
        elif worker.running or worker.prefilling:
            if (done := worker.local.advance()) is not None:  # one chunk, then one step of the batch
                worker.arrived[done[0]] = done[1]
            if worker.running:
                worker.step_locked()
        else:
            worker.wake.wait()  # an arrival or shutdown wakes it
        return 0.0

    def _run_in_lockstep(self) -> None:
        worker, lockstep = self.worker, self.worker.lockstep
        if lockstep is None:
            raise RuntimeError("lockstep rounds need the worker's Lockstep (a TP group)")
        behind = False  # the last round ended waiting for what this rank lacked
        try:
            while True:
                with worker.lock:
                    while not lockstep.bound and not self.stopping:
                        worker.wake.wait()  # the group forms once every rank has started
                    idle = not (self.stopping or behind or worker.running or worker.arrived)
                    if worker.rank == 0 and idle:
                        worker.wake.wait(LOCKSTEP_IDLE_S)
                    stop = self.stopping
                if not lockstep.go(stop):
                    return
                with worker.lock:
                    lacking = self._verify_in_lockstep()  # another rank holds one not landed here
                    rids = lockstep.common(list(worker.running))
                    if rids:
                        worker.step_locked(rids)
                    behind = not rids and (lacking or bool(worker.running)) and not self.stopping
                    if behind:
                        # What the round waits for happens here: that request lands, or one that runs
                        # here only (the others gave it up) is given up here too. Either wakes it, and
                        # the lock held since the round began means neither is missed.
                        worker.wake.wait(LOCKSTEP_IDLE_S)
        except Exception as exc:  # the ranks are out of step for good
            with worker.lock:
                worker.fail_loop_requests(exc)
            worker.group_broken(exc)

    def _verify_in_lockstep(self) -> bool:
        """Under the lock, on every rank at once: verify the requests arrived on every rank; admit
        those that passed on every rank, and fail the others as corrupt on every rank. Whether
        another rank holds an arrived request that has not landed here."""
        worker, lockstep = self.worker, self.worker.lockstep
        if lockstep is None:
            raise RuntimeError("lockstep rounds need the worker's Lockstep (a TP group)")
        landed = lockstep.agree(list(worker.arrived))
        if not landed.common:  # the same answer on every rank: none gathers further
            return landed.lacking
        passed = worker.arrivals.check(landed.common)
        everywhere = lockstep.common(passed)
        for rid in set(passed) - set(everywhere):
            worker.arrivals.fail_elsewhere(rid)
        worker.arrivals.admit(everywhere)
        return landed.lacking
