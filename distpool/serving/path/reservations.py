"""Where a request's destination is reserved: the driver's side of `DecodeWorker.reserve`.

By default the destination is reserved on one decode worker while prefill computes: the transfer's
header waits at the receiver for the reservation (`transfer.defaults.UNEXPECTED_WAIT_S`), and a
refused reservation refuses the header at once. A worker that refused a reservation within
`REFUSAL_MEMORY_S` (prefill work would likely be wasted), or `overlap` off (`--reserve-first`), has
the driver reserve first, trying every candidate, and ask prefill after.
"""

from __future__ import annotations

import asyncio
import math
import time

from distpool.memory.pool import DoesNotFit
from distpool.serving.deploy import Deployment
from distpool.serving.path.attempt_errors import AdmissionTimedOut, Busy, Retry
from distpool.serving.path.attempts import Attempts
from distpool.serving.routing import Router
from distpool.serving.workloads import Request
from transfer import ChannelError, FailureKind

# A decode worker that refused a reservation this recently is asked first, before prefill starts: a
# reservation made while prefill computes would likely be refused again, and the prefill wasted.
REFUSAL_MEMORY_S = 1.0


class Reservations:
    def __init__(
        self,
        deployment: Deployment,
        router: Router,
        attempts: Attempts,
        *,
        overlap: bool,
        cache_affinity: bool,
        admission_timeout_s: float,
    ) -> None:
        self.deployment, self.router, self.attempts = deployment, router, attempts
        self.overlap, self.cache_affinity = overlap, cache_affinity
        self.admission_timeout_s = admission_timeout_s
        self.refused_at: dict[str, float] = {}  # decode worker -> when it last refused a reservation

    def overlap_candidate(self, req: Request, prefill_name: str, avoid: set[str]) -> str | None:
        """The decode worker to reserve on while prefill computes (counted in flight), or None: reserve
        first, trying every candidate (`overlap` off, or the likeliest
        worker refused a reservation within `REFUSAL_MEMORY_S`: prefill work would likely be wasted)."""
        if not self.overlap:
            return None
        if prefill_name in self.router.dead:  # it died since it was chosen: choose again
            raise Retry(FailureKind.WORKER_LOST, f"{prefill_name} died")
        name = self.router.decode_candidates(avoid, keys=self._keys(req))[0]
        if time.monotonic() - self.refused_at.get(name, -math.inf) < REFUSAL_MEMORY_S:
            return None
        self.router.begin(name)
        return name

    def _keys(self, req: Request) -> list[bytes] | None:
        """What routing matches decode caches by: the prompt's block keys (None: no affinity)."""
        return req.block_keys(self.router.page_size) if self.cache_affinity else None

    async def settle(
        self, reserving: asyncio.Task, sending: asyncio.Future, decode_name: str, avoid: set[str]
    ) -> None:
        """Wait for a reservation made while prefill computes. Refused (no room, a dead or silent
        worker, a broken channel): prefill's transfer is refused in turn and frees its side; once
        it has, Busy (tried again without counting an attempt, on another worker first)."""
        try:
            await reserving
            return
        except asyncio.CancelledError:
            reserving.cancel()
            raise
        except (DoesNotFit, Retry, ChannelError) as exc:
            refusal = exc
        await asyncio.wait([sending])  # decode refuses its header at once (or its channel fails)
        if not sending.cancelled():
            sending.exception()  # its outcome does not matter: the attempt is over
        if isinstance(refusal, DoesNotFit):
            self.refused_at[decode_name] = time.monotonic()
        else:
            avoid.add(decode_name)
        raise Busy(f"{decode_name}: {refusal}")

    async def reserve_on(self, name: str, req: Request, prefill_name: str) -> None:
        """Reserve the destination on decode worker `name`, expected from `prefill_name`."""
        ref = self.deployment.decode[name].reserve.remote(
            req.request_id, req.prompt, req.params, prefill_name
        )
        await self.attempts.call(name, ref)  # the destination's envelope stays on the decode worker

    async def reserve_first(self, req: Request, prefill_name: str, avoid: set[str]) -> str:
        """Reserve on the first decode worker with room (the one caching the longest prefix of the
        prompt first), before prefill starts; its name. None has room: waits for room to free
        (`Attempts.room`) and tries again, for up to `admission_timeout_s`."""
        deadline = time.monotonic() + self.admission_timeout_s
        while True:
            room = self.attempts.room  # set once room frees after this pass began
            if prefill_name in self.router.dead:  # it died since it was chosen: choose again
                raise Retry(FailureKind.WORKER_LOST, f"{prefill_name} died")
            for name in self.router.decode_candidates(avoid, keys=self._keys(req)):
                # Counted as in flight from the moment of asking, so concurrent requests spread out.
                self.router.begin(name)
                try:
                    await self.reserve_on(name, req, prefill_name)
                    return name
                except DoesNotFit:
                    self.router.end(name)
                    self.refused_at[name] = time.monotonic()
                except (Retry, ChannelError):  # that worker died, or its channel to the prefill did
                    self.router.end(name)
                    avoid.add(name)  # a silent one may still hold this reservation when it resumes
                except BaseException:
                    self.router.end(name)
                    raise
            if time.monotonic() > deadline:
                raise AdmissionTimedOut(req.request_id, self.admission_timeout_s)
            await self.attempts.wait_for(room, deadline - time.monotonic())
