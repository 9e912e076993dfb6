"""Worker loss and return: the driver's side of Ray's actor restarts.

A call that raises `RayActorError` marks its worker lost at once: the router stops choosing it, the
requests waiting on it fail (and are retried elsewhere), and its peers drop their channels to it so
nothing of theirs waits on it. So does a worker that stops answering (`kill -STOP`, a hung node):
every call goes through `call`, which pings the worker whenever the call has gone `silence_s`
without an answer; no answer to the ping within PING_TIMEOUT_S either, and the worker is lost (a
worker that answers the ping is only slow, and its call is waited on further). Ray restarts a dead
actor (`max_restarts` in the deployment); a TP group's other ranks are restarted with it, so the
group comes back as one (`Deployment.take_down`); this module waits for the worker to answer again,
rebuilds its channels to every live peer, and gives it back to the router. A worker that does not
come back within `REJOIN_TIMEOUT_S` stays lost.

    alive --(RayActorError, or silent)--> lost --(answers ping, channels rebuilt)--> alive (restarted)
                                            \\----(no answer in time)--------------> lost for good
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ray.exceptions import RayActorError

from distpool.serving.deploy.deployment import Deployment
from distpool.serving.deploy.tp_group import GroupDown
from distpool.serving.routing import Router

REJOIN_TIMEOUT_S = 60.0
PING_TIMEOUT_S = 5.0
PING_INTERVAL_S = 0.25
SETTLE_S = 15.0  # the longest a run's end waits for a restarting worker


class WorkerLost(Exception):
    """A call's worker died or stopped answering; it is marked lost."""


class Recovery:
    """Tracks lost workers and brings restarted ones back. `on_lost(name)` runs when a worker is
    lost (the driver fails what waits on it), `on_return(name)` once it is serving again (the driver
    restarts its result stream)."""

    def __init__(
        self,
        deployment: Deployment,
        router: Router,
        *,
        on_lost: Callable[[str], None],
        on_return: Callable[[str], None],
    ) -> None:
        self.dep, self.router, self.on_lost, self.on_return = deployment, router, on_lost, on_return
        self.lost: list[str] = []  # every loss, in order (a worker may be lost twice)
        self.why: dict[str, str] = {}  # worker -> how it was lost last: "died", "stopped answering ..."
        self.restarted: list[str] = []
        self.rejoining: dict[str, asyncio.Task] = {}  # kept: a task nobody holds may be collected
        self.returned_at: dict[str, float] = {}  # monotonic time each restarted worker rejoined

    @property
    def pending(self) -> bool:
        """Whether some lost worker may still come back."""
        return any(not task.done() for task in self.rejoining.values())

    async def settle(self) -> None:
        """Wait (at most SETTLE_S) for workers still on their way back, so the summary says how they
        ended up; a worker gone for good costs that wait once."""
        pending = [task for task in self.rejoining.values() if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=SETTLE_S)

    async def call(self, name: str, awaitable, *, silence_s: float):
        """Await a call to worker `name`; raise WorkerLost (the worker is then lost) if it died, or
        if the call went `silence_s` without an answer and the worker answers no ping either."""
        called_at = time.monotonic()
        call = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=silence_s)
                if done:
                    return call.result()
                if not await self.answers(name):
                    reason = f"stopped answering (a call {silence_s:g} s, a ping {PING_TIMEOUT_S:g} s)"
                    self.lose(name, called_at, reason)
                    raise WorkerLost(f"{name} {reason}")
        except (RayActorError, GroupDown) as exc:  # GroupDown: a TP group lost already, call not made
            self.lose(name, called_at, "died")
            raise WorkerLost(f"{name} died") from exc
        finally:
            call.cancel()  # given up (or done: then this changes nothing); the worker may still run it

    async def answers(self, name: str) -> bool:
        """Whether worker `name` answers a ping within PING_TIMEOUT_S."""
        try:
            await asyncio.wait_for(self.dep.handles()[name].ping.remote(), PING_TIMEOUT_S)
            return True
        except (RayActorError, TimeoutError):
            return False

    def lose(self, name: str, called_at: float, why: str = "died") -> None:
        """A call to `name` made at `called_at` found it dead (or silent): stop using it and wait for
        its return. A call made before the worker last rejoined speaks of its previous life and is
        ignored."""
        if name in self.router.dead or called_at < self.returned_at.get(name, float("-inf")):
            return
        self.router.mark_dead(name)
        self.lost.append(name)
        self.why[name] = why
        self.on_lost(name)
        peers = self.dep.decode if name in self.dep.prefill else self.dep.prefill
        for peer, handle in peers.items():
            if peer not in self.router.dead:
                # Fire and forget: it fails its transfers with this life of `name`.
                handle.peer_lost.remote(name, self.dep.lives.get(name, 0))
        self.rejoining[name] = asyncio.get_running_loop().create_task(self._rejoin(name))

    async def _rejoin(self, name: str) -> None:
        deadline = time.monotonic() + REJOIN_TIMEOUT_S
        # Forming a group and rebuilding channels end within their own timeouts on the workers;
        # a rank that stops answering meanwhile must not hold the rejoin past that.
        forming_s = self.dep.spec.worker.transfer.timeout_s + PING_TIMEOUT_S
        while True:
            await self.dep.take_down(name)  # a TP group's other ranks go down with the lost one
            if not await self._restarted(name, deadline):
                print(f"distpool: {name} did not come back within {REJOIN_TIMEOUT_S:.0f} s", flush=True)
                return
            try:  # past TP 1 the new ranks form their group first
                await asyncio.wait_for(self.dep.form_tp_group_async(name), forming_s)
                break
            except Exception as exc:  # a rank died again meanwhile: down and back once more, in time
                if time.monotonic() > deadline:
                    why = f"{name} restarted but its ranks could not form their group"
                    print(f"distpool: {why}: {type(exc).__name__}: {exc}", flush=True)
                    return
        self.dep.lives[name] = self.dep.lives.get(name, 0) + 1  # channels from here on are to the new life
        is_prefill = name in self.dep.prefill
        peers = [
            p for p in (self.dep.decode if is_prefill else self.dep.prefill) if p not in self.router.dead
        ]
        pairs = [(name, p) if is_prefill else (p, name) for p in peers]
        try:
            connecting = asyncio.gather(*(self.dep.connect_async(p, d) for p, d in pairs))
            await asyncio.wait_for(connecting, forming_s)
        except Exception as exc:  # a peer died meanwhile, or the link is down: stay lost
            print(f"distpool: {name} restarted but its channels could not be rebuilt: {exc}", flush=True)
            return
        self.router.revive(name)
        self.restarted.append(name)
        self.returned_at[name] = time.monotonic()
        print(f"distpool: {name} restarted and rejoined {len(pairs)} channel(s)", flush=True)
        self.on_return(name)

    async def _restarted(self, name: str, deadline: float) -> bool:
        """Wait until every rank of `name` answers in a new life; False if none by `deadline`."""
        while True:
            try:
                if await self.dep.answers(name, PING_TIMEOUT_S):
                    return True
            except (RayActorError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(PING_INTERVAL_S)
