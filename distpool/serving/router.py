"""Request routing: which decode worker gets a request, which prefill worker runs it.

Pure bookkeeping over worker names (no Ray here), so it is unit-tested directly. The decode side is
chosen by trying reservations in `decode_candidates` order (the worker itself knows whether it has
room); the prefill side is the live worker with the fewest requests in flight.
"""

from __future__ import annotations

from collections import Counter


class NoWorkerAlive(RuntimeError):
    """Every worker of one role is dead: nothing can be served."""


class Router:
    def __init__(self, prefill_names: list[str], decode_names: list[str]) -> None:
        if not prefill_names or not decode_names:
            raise ValueError("a deployment needs at least one prefill and one decode worker")
        self.prefill_names = list(prefill_names)
        self.decode_names = list(decode_names)
        self.dead: set[str] = set()
        self.in_flight: Counter[str] = Counter()

    def alive(self, names: list[str]) -> list[str]:
        return [n for n in names if n not in self.dead]

    def pick_prefill(self) -> str:
        """The least-loaded live prefill worker (ties go to the first listed)."""
        live = self.alive(self.prefill_names)
        if not live:
            raise NoWorkerAlive("every prefill worker is dead")
        return min(live, key=lambda n: self.in_flight[n])

    def decode_candidates(self, avoid: set[str] = frozenset()) -> list[str]:
        """Live decode workers, least loaded first; workers in `avoid` (e.g. one that just failed this
        request) go last rather than being excluded, so a single decode worker can still retry."""
        live = self.alive(self.decode_names)
        if not live:
            raise NoWorkerAlive("every decode worker is dead")
        return sorted(live, key=lambda n: (n in avoid, self.in_flight[n]))

    def begin(self, *names: str) -> None:
        for n in names:
            self.in_flight[n] += 1

    def end(self, *names: str) -> None:
        for n in names:
            assert self.in_flight[n] > 0, f"{n} has no request in flight"
            self.in_flight[n] -= 1

    def mark_dead(self, name: str) -> None:
        self.dead.add(name)

    def revive(self, name: str) -> None:
        """A restarted worker serves again (requests still counted on it end as they fail)."""
        self.dead.discard(name)
